"""benchmarks/generate.py's CPU smoke: our engine against HF transformers' generate on a tiny random Qwen2, end to
end (fixed batches, the mixed workload, the JSON, the table and the plot), so that the host side of the GPU
benchmark cannot rot unseen; and the two agree on that model's greedy tokens and their logprobs."""
import json

import torch

from tests.helpers import run_benchmark


def test_the_generate_benchmark_runs_on_the_cpu(tmp_path):
    done = run_benchmark("generate", "--device", "cpu", "--out", str(tmp_path), timeout=180)
    result = json.loads((tmp_path / "generate.json").read_text())
    assert result["gpu"] == "cpu" and result["commit"] and result["weight_read_floor_ms"] is None
    ours, hf = result["ours"], result["hf"]
    assert list(ours) == ["batch1", "batch2", "mixed"] and list(hf) == ["batch1", "batch2"]
    for case, batch in (("batch1", 1), ("batch2", 2)):  # 8 new tokens a request, for ours and for HF
        for r in (ours[case], hf[case]):
            assert r["tokens"] == 8 * batch and r["tok_per_s"] == r["tokens"] / r["seconds"] > 0, (case, r)
    # The mixed workload: 4 requests of 4..32 new tokens, each run to its length.
    mixed = ours["mixed"]
    assert 16 <= mixed["tokens"] <= 128 and mixed["tok_per_s"] == mixed["tokens"] / mixed["seconds"] > 0
    assert 0 < mixed["ttft_median_ms"] <= mixed["ttft_p99_ms"] and mixed["decode_step_median_ms"] > 0
    # The table's speedups are ours over HF's tok/s, case by case; none for mixed (HF does not run it), and no
    # weight-read floor on the CPU.
    table = done.stdout.split("ours tok/s")[1].splitlines()[1:4]
    rows = {line.split()[0]: line.split() for line in table}
    for case in ("batch1", "batch2"):
        assert rows[case][3] == f"{ours[case]['tok_per_s'] / hf[case]['tok_per_s']:.1f}x", rows[case]
    assert rows["mixed"][2:4] == ["-", "-"] and all(row[5] == "-" for row in rows.values())
    assert (tmp_path / "generate.png").stat().st_size > 10_000


def test_our_greedy_tokens_and_logprobs_match_hf_on_the_tiny_checkpoint(tmp_path):
    """The smoke's checkpoint in float32: the same greedy tokens as HF's generate, each token's logprob within
    float32's rounding of HF's (the prefill's first token, then the decode steps'). The random weights (std 0.02)
    barely move the logits: the greedy token repeats the prompt's last, so the logprobs carry the check, and their
    tolerance is tight (one layer's k bias left out moves them 4e-5; float32 rounding, 5e-7)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.generate import TINY_CONFIG, write_checkpoint
    from service.engine.llm import LLM
    from service.protocol import SamplingParams

    write_checkpoint(tmp_path, TINY_CONFIG, "cpu")
    prompt = torch.randint(0, TINY_CONFIG["vocab_size"], (16,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = LLM(str(tmp_path), device="cpu", dtype="float32").engine
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True))
    outputs = []
    while engine.has_work:
        outputs += engine.step()[0]
    tokens, logprobs = [o.token_id for o in outputs], torch.tensor([o.logprob for o in outputs])

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    hf_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                            do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert tokens == hf_tokens
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    hf_logprobs = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(logprobs, hf_logprobs, rtol=0, atol=1e-5)
