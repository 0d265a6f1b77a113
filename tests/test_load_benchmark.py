"""benchmarks/load.py's CPU smoke: the service started by its CLI on the embedded model, the shipped locust
workload against it at one user count, and the table's numbers from locust's CSV and the service's /metrics."""
import json

from tests.helpers import run_benchmark


def test_the_load_benchmark_runs_on_the_cpu(tmp_path):
    run_benchmark("load", "--device", "cpu", "--users", "2", "--seconds", "6", "--out", str(tmp_path), timeout=300)
    result = json.loads((tmp_path / "load.json").read_text())
    assert (result["device"], result["model"], result["seconds_per_level"]) == ("cpu", "the embedded model", 6)
    assert result["commit"] and result["date"]
    (level,) = result["results"]
    assert level["users"] == 2 and level["requests"] > 0 and level["failures"] == 0, level
    # tokens from the service's own counters over the level, latencies from locust's CSV
    assert level["output_tok_per_s"] > 0 and level["input_tok_per_s"] > 0, level
    assert 0 < level["ttft_p50_ms"] <= level["ttft_p99_ms"] and 0 < level["itl_p50_ms"] <= level["itl_p99_ms"], level
    assert (tmp_path / "load.png").stat().st_size > 0
