"""benchmarks/sizing.py: its formulas against hand arithmetic and against the engine's own sharded model, and the
script end to end (CPU only, no weights)."""
import pytest
import torch

from benchmarks import sizing

LLAMA_8B, LLAMA_70B = sizing.MODELS["Llama-3-8B"], sizing.MODELS["Llama-3-70B"]


def test_llama_3_8b_parameters_and_kv_per_token_by_hand():
    # per layer: q and o 4096 x 4096, k and v 4096 x (8 x 128), gate/up/down 4096 x 14336, two norms of 4096
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    # untied embeddings and LM head 128256 x 4096, final norm
    assert sizing.param_count(LLAMA_8B) == 32 * layer + 2 * 128256 * 4096 + 4096 == 8_030_261_248
    assert sizing.param_count(LLAMA_70B) == pytest.approx(70.55e9, rel=1e-3)
    # K and V, 32 layers, 8 KV heads of 128, 2 bytes (bf16)
    assert sizing.kv_bytes_per_token(LLAMA_8B, 1) == 2 * 32 * 8 * 128 * 2 == 131072
    assert sizing.kv_bytes_per_token(LLAMA_8B, 2) == 131072 // 2
    assert sizing.kv_bytes_per_token(LLAMA_8B, 8) == 131072 // 8


def test_kv_heads_are_replicated_beyond_the_kv_head_count():
    assert [sizing.local_kv_heads(LLAMA_8B, t) for t in (1, 2, 8, 16, 32)] == [8, 4, 1, 1, 1]
    # At TP16 each rank still holds a whole KV head: no less KV per token than at TP8, q still split 16 ways.
    assert sizing.kv_bytes_per_token(LLAMA_8B, 16) == sizing.kv_bytes_per_token(LLAMA_8B, 8) == 2 * 32 * 128 * 2
    q16 = 32 // 16 * 128
    layer16 = 2 * 4096 * q16 + 2 * 4096 * 128 + 3 * 4096 * (14336 // 16) + 2 * 4096
    assert sizing.param_count(LLAMA_8B, 16) == 32 * layer16 + 2 * (128256 // 16) * 4096 + 4096
    with pytest.raises(ValueError):
        sizing.local_kv_heads(LLAMA_8B, 3)  # 32 query heads do not split 3 ways: the engine refuses it too


@pytest.mark.parametrize("tp", [1, 2, 8, 16])
def test_param_count_is_what_the_engine_builds_per_rank(tp):
    from service.model import LlamaForCausalLM, ModelConfig
    from service.model.parallel import TensorParallel

    cfg = ModelConfig.from_dict(LLAMA_8B)
    with torch.device("meta"):  # shapes only, no memory
        model = LlamaForCausalLM(cfg, TensorParallel(rank=tp - 1, size=tp))
    assert sum(p.numel() for p in model.parameters()) == sizing.param_count(LLAMA_8B, tp)


def test_kv_blocks_follow_the_engines_budget():
    gpu, reserve = 80 * 2**30, 2**30
    weights = 8_030_261_248 * 2 + 131072 * 128 * 4  # bf16 weights and the fp32 RoPE table (128k x 128)
    blocks = int(gpu * 0.9 - weights - reserve) // (131072 * 16)
    assert sizing.kv_blocks(LLAMA_8B, 1, gpu, reserve) == blocks
    assert sizing.seqs_that_fit(blocks, 4096) == min(256, blocks // 256)
    assert sizing.seqs_that_fit(10**9, 32768) == 256  # capped by max_num_seqs
    # The 70B's 141 GB of bf16 weights do not fit one GPU; on two they do, with some KV room.
    one, two = sizing.size_layout("Llama-3-70B", 1, 1), sizing.size_layout("Llama-3-70B", 2, 1)
    assert not one["weights_fit"] and one["blocks"] == 0 and one["seqs"][4096] == 0
    assert two["weights_fit"] and two["blocks"] > 0
    # DP engines each hold what one engine of their TP degree holds.
    assert sizing.size_layout("Llama-3-8B", 1, 8)["tokens"] == sizing.size_layout("Llama-3-8B", 1, 1)["tokens"]


def test_script_writes_the_table(tmp_path, capsys):
    out = tmp_path / "results" / "sizing.md"
    sizing.main(["--out", str(out)])
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert f"`python benchmarks/sizing.py --out {out}`" in " ".join(text.split())  # the wrapped header line
    rows = [line for line in text.splitlines() if line.startswith("| Llama-3")]
    assert len(rows) == 2 * sum(len(layouts) for layouts in sizing.LAYOUTS.values()) == 14
    assert all(row.count("|") == rows[0].count("|") for row in rows)
    assert sum("weights do not fit" in row for row in rows) == 3  # 70B at TP1: on 1 GPU, DP2, DP8
    assert "| Llama-3-8B | 1 | TP1 | 15.0 | 128 |" in text
    assert "## When to use which" in text
    assert all(len(line) <= 120 for line in text.splitlines() if not line.startswith("|"))
