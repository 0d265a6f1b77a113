"""Loads a model directory (or hub id): config, safetensors weights straight onto the device, tokenizer."""
import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from service.config import local_model_dir
from service.model.config import ModelConfig
from service.model.llama import LlamaForCausalLM
from service.model.parallel import SINGLE, VOCAB_SPLIT, TensorParallel, check_divisible, shard_range

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_model_dir(model: str | None) -> Path:
    """None -> the embedded default model; an existing directory; else a hub id downloaded (weights, config,
    tokenizer only)."""
    local = local_model_dir(model)
    if local is not None:
        return local
    from huggingface_hub import snapshot_download
    log.info("downloading %s from the Hugging Face hub", model)
    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32  # CPU matmuls in half precision are slow and less accurate
    return DTYPES.get(cfg.torch_dtype or "bfloat16", torch.bfloat16)


def load_model(model_dir, dtype: torch.dtype, device, tp: TensorParallel = SINGLE) -> LlamaForCausalLM:
    """The model on `device`; under tensor parallelism, the slices of rank tp.rank, each read from the file alone."""
    model_dir, device = Path(model_dir), torch.device(device)
    cfg = ModelConfig.from_dir(model_dir)
    check_divisible(cfg, tp.size)
    with torch.device("meta"):  # no memory and no random init until the weights arrive
        model = LlamaForCausalLM(cfg, tp).to(dtype)
    model = model.to_empty(device=device)
    if tp.size > 1:  # the last rank's vocabulary slice has padding rows past the checkpoint's
        model.model.embed_tokens.weight.data.zero_()
        model.lm_head.weight.data.zero_()
    if cfg.tie_word_embeddings:  # to_empty gave the two names separate storage
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.rebuild(device)
    params = dict(model.named_parameters())
    missing = set(params)
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no .safetensors files in {model_dir}")
    # A bar on a terminal (tqdm turns itself off when stderr is not one); the log gets a line per shard.
    bar = tqdm(total=sum(p.nbytes for p in params.values()), unit="B", unit_scale=True, desc="loading weights",
               disable=None)
    for i, shard in enumerate(shards):
        start = time.perf_counter()
        with safe_open(shard, framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name not in params:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings or "rotary_emb" in name:
                        continue
                    raise ValueError(f"unexpected tensor {name!r} in {shard.name}")
                tensor, target = _read(f, name, cfg, tp), params[name]
                if tp.size > 1 and name.split(".")[-2] in VOCAB_SPLIT:  # the last rank's slice is padded
                    target = target[:tensor.shape[0]]
                if tensor.shape != target.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} "
                                     f"!= model {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor)
                missing.discard(name)
                bar.update(params[name].nbytes)
        log.info("loaded shard %d/%d %s in %.1fs", i + 1, len(shards), shard.name, time.perf_counter() - start)
    bar.close()
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
    if device.type == "cuda":
        model.fuse_projections()
    return model.eval()


def _read(f, name: str, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """The tensor, or the rank's slice of it (read alone: a rank never holds the whole weight)."""
    parts = name.split(".")
    shard = shard_range(parts[-2], cfg, tp) if len(parts) >= 2 else None
    if shard is None:
        return f.get_tensor(name)
    dim, start, stop = shard
    piece = f.get_slice(name)
    return piece[start:stop] if dim == 0 else piece[:, start:stop]


def eos_token_ids(model_dir) -> set[int]:
    """EOS ids from generation_config.json and config.json (int or list) plus the tokenizer's."""
    from service.text import eos_token_id

    ids = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    tokenizer_eos = eos_token_id(model_dir)
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return ids
