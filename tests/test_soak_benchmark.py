"""benchmarks/soak.py on the CPU, shortened: mixed load with disconnects, structured outputs, tool calls, fan-out,
logit_bias, bad requests and a fine-tuning job against the real server with the embedded model; the run must pass
and its JSON carry what the plot shows."""
import json

from tests.helpers import run_benchmark


def test_a_short_soak_passes_on_the_cpu(tmp_path):
    run_benchmark("soak", "--device", "cpu", "--minutes", "0.4", "--streams", "4", "--interval", "3", "--out",
                  str(tmp_path), timeout=300)
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["verdict"]["passed"] and len(result["samples"]) == 8 and (tmp_path / "soak.png").stat().st_size
    assert set(result["verdict"]["checks"]) == {"no good request failed", "bad requests got 4xx", "gauges back to 0",
                                                "fine-tuning job succeeded", "host memory flat"}
    totals = result["totals"]
    assert totals["good_ok"] > 20 and totals["bad_4xx"] > 0 and "good_failed" not in totals
    # The newer surface ran too (the embedded model spells JSON: schemas and forced tool calls, not their stand-ins).
    # Each client draws its kinds from a fixed seed: by every client's 7th request, all four have come up.
    assert result["json_outputs"] and {"structured", "tools", "fan_out", "logit_bias"} <= set(result["kinds"])
    sample = result["samples"][-1]
    assert sample["rss_bytes"] > 0 and sample["job"] == "succeeded" and sample["ttft_p99_ms"] is not None
    # ITL once the fine-tuned model serves, against before the job (a verdict check on the GPU only)
    itl = result["adapters_itl"]
    assert itl["intervals"][1] >= 1 and sum(itl["intervals"]) <= 8 and itl["adapter_live_p50_ms"] > 0
