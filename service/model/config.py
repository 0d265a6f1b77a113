"""The parts of a Hugging Face config.json the model needs, checked once at load."""
import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    torch_dtype: str | None

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(SUPPORTED)}")
        if d.get("sliding_window") and d.get("use_sliding_window", arch == "MistralForCausalLM"):
            if d["sliding_window"] < d.get("max_position_embeddings", 0):
                raise ValueError("sliding-window attention is not supported")
        heads = d["num_attention_heads"]
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: default, llama3")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )

    @classmethod
    def from_dir(cls, path) -> "ModelConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))
