"""benchmarks/load.py's CPU smoke: the service started by its CLI on the embedded model, the shipped locust
workload against it at one user count, and the table's numbers from locust's CSV and the service's /metrics."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_load_benchmark_runs_on_the_cpu(tmp_path):
    argv = [sys.executable, "benchmarks/load.py", "--device", "cpu", "--users", "2", "--seconds", "6",
            "--out", str(tmp_path)]
    done = subprocess.run(argv, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "load.json").read_text())
    assert (result["device"], result["model"], result["seconds_per_level"]) == ("cpu", "the embedded model", 6)
    assert result["commit"] and result["date"]
    (level,) = result["results"]
    assert level["users"] == 2 and level["requests"] > 0 and level["failures"] == 0, level
    # tokens from the service's own counters over the level, latencies from locust's CSV
    assert level["output_tok_per_s"] > 0 and level["input_tok_per_s"] > 0, level
    assert 0 < level["ttft_p50_ms"] <= level["ttft_p99_ms"] and 0 < level["itl_p50_ms"] <= level["itl_p99_ms"], level
    assert (tmp_path / "load.png").stat().st_size > 0
