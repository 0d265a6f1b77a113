"""benchmarks/finetune.py on the CPU, shortened: our trainer (with the chunked loss and the plain one) and
transformers + PEFT take turns on a tiny model, the profiler tables, then decode streams beside a fine-tuning job;
the run must pass and its JSON carry the rows the results README is written from (the host side of the GPU
benchmark cannot rot unseen)."""
import json

from tests.helpers import run_benchmark


def test_model_flops_count_what_the_docstring_says():
    from benchmarks.finetune import CONFIG, flops_per_token

    # Qwen2.5-0.5B: 24 x (q 896x896, k and v 896x128, o 896x896, gate/up/down 896x4864) + the LM head 151936x896
    frozen = 24 * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864) + 151936 * 896
    adapter = 24 * 16 * ((896 + 896) * 2 + (896 + 128) * 2 + (896 + 4864) * 3)  # rank 16 x (in + out)
    assert flops_per_token(CONFIG, 2048) == 4 * frozen + 6 * adapter + 7 * 2048 * 64 * 14 * 24


def test_a_short_finetune_benchmark_runs_on_the_cpu(tmp_path):
    run_benchmark("finetune", "--device", "cpu", "--profile", "--plain-loss", "--out", str(tmp_path), timeout=300)
    result = json.loads((tmp_path / "finetune.json").read_text())
    assert [(r["micro_batch"], r["seq_len"]) for r in result["training"]] == [(2, 32), (1, 64)]
    for row in result["training"]:
        for name in ("ours", "ours_plain_loss", "peft_sdpa"):
            side = row[name]
            assert len(side["runs_tokens_per_s"]) == 2 and side["tokens_per_s"] == max(side["runs_tokens_per_s"]) > 0
        assert row["speedup_vs_peft_sdpa"] > 0 and row["flops_per_token"] > 0
    assert result["sides"]["peft_flash_attn_2"].startswith("skipped")
    assert result["optimizer"]["lr"] > 0 and "peft" in result["versions"]
    (profile,) = result["profile"]
    assert profile["cpu_self_ms_per_step"] > 0 and profile["operators_by_cpu_time"]
    serving = {r["condition"]: r for r in result["serving"]}
    assert list(serving) == ["serving alone", "+ training, duty 0.5", "+ training, duty 1.0"]
    assert all(r["decode_tokens_per_s"] > 0 for r in serving.values())
    assert serving["+ training, duty 1.0"]["training_tokens_per_s"] > 0
