"""Which base model a LoRA adapter belongs to: the architecture, the shapes adapters depend on, and a hash of a
fixed sample of the weights. An adapter stores its base's fingerprint (service.model.lora), and a server serves
only the adapters whose fingerprint is its own: one of another base either fails on mismatched shapes or, where the
shapes agree, silently serves garbage.

The sample is the [:4, :4] corner of every weight (the first 4 values of a vector), never a whole tensor, so the
fingerprint of a 70B model costs a few hundred tiny slices. It is hashed after rounding to bfloat16: a checkpoint
loaded in bfloat16 (on the GPU) and in float32 (on the CPU) gets the same fingerprint, since loading it in bfloat16
rounds its values the same way. (Float16 loads of checkpoints in other dtypes can differ in a sampled value's last
bit: their adapters are then refused, never served on the wrong weights.)
"""
import hashlib

import torch
from torch import nn

CORNER = 4
SHAPES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "vocab_size")


def fingerprint(model: nn.Module) -> dict:
    """The model's fingerprint (JSON-able). Under tensor parallelism only rank 0's is the whole model's: every slice
    rank 0 holds starts at row and column 0 and spans at least a head (4+ values), so it holds each corner whole;
    other ranks hold other values (and need no fingerprint: they serve the adapters rank 0 accepted)."""
    tp = getattr(model, "tp", None)
    if tp is not None and tp.rank != 0:
        raise ValueError(f"rank {tp.rank} holds slices that are not the base model's corners; ask rank 0")
    cfg = model.config
    digest = hashlib.sha256()
    corners = []
    for name, p in model.named_parameters():  # a tied LM head is listed once, under its embedding's name
        digest.update(name.encode())
        corners.append(p.detach()[(slice(0, CORNER),) * p.dim()].flatten())
    sample = torch.cat(corners).to(torch.bfloat16).cpu()
    digest.update(sample.view(torch.int16).numpy().tobytes())
    return {"architecture": cfg.architecture, **{k: getattr(cfg, k) for k in SHAPES},
            "weights": digest.hexdigest()[:16]}


def describe(fp: dict) -> str:
    """A fingerprint for a log line."""
    return (f"{fp['architecture']} with {fp['num_hidden_layers']} layers of {fp['hidden_size']} (heads "
            f"{fp['num_attention_heads']}/{fp['num_key_value_heads']} x {fp['head_dim']}, MLP "
            f"{fp['intermediate_size']}, vocabulary {fp['vocab_size']}), weights {fp['weights']}")
