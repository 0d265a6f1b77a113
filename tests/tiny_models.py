"""Tiny random Hugging Face checkpoints (Llama with llama3 RoPE scaling, Qwen2, Qwen3) for tests: saved with
transformers' own save_pretrained plus the embedded default model's tokenizer, so they load like real ones."""
import shutil
from pathlib import Path

import torch

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "service" / "default_model"
VOCAB = 4096  # the embedded tokenizer's
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=2)
KINDS = ("llama", "qwen2", "qwen3")


def make_tiny_model(kind: str, path, dtype=torch.float32, seed: int = 0, **overrides) -> Path:
    """Writes a tiny random `kind` checkpoint (config.json, model.safetensors, tokenizer files) to path; overrides:
    config fields other than COMMON's values (num_key_value_heads=1, say)."""
    import transformers

    torch.manual_seed(seed)
    common = {**COMMON, **overrides}
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(f"unknown kind {kind!r}, choose from {KINDS}")
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomize them so they are tested
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    path = Path(path)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path / name)
    return path
