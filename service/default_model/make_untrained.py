"""Builds the embedded default model: a byte-level BPE tokenizer trained on the Python standard library's
source (text present on any machine with Python) and a small Llama with seeded random, *untrained* weights.

    python -m service.default_model.make_untrained [--out DIR]

Deterministic: the same Python version gives the same files. The fine-tuning tooling may later replace
model.safetensors with trained weights of the same shapes.
"""
import argparse
import json
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 3072
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # bos/pad, turn start, eos (turn end)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_comment": "untrained: seeded random weights",
    "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
}


def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(stdlib.glob("*.py"))]


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus(), trainer)
    return tok


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": normal(cfg["vocab_size"], h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
              p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
              p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
              p + "mlp.down_proj.weight": normal(h, inter),
              p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    return w


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[2],
        "pad_token": SPECIAL[0], "add_bos_token": False, "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "bos_token_id": 0}) + "\n")
    save_file(random_weights(CONFIG), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text("Embedded default model: a 4-layer Llama, UNTRAINED (seeded random weights; "
                                   "it generates gibberish), with a byte-level BPE tokenizer trained on the Python "
                                   "standard library. Rebuild: python -m service.default_model.make_untrained\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
