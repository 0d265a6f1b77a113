"""Serving under load: TTFT, inter-token latency and throughput of the service at increasing user counts.

python benchmarks/load.py [--out DIR] [--users 1,8,32,128] [--seconds 30] [--model DIR]
python benchmarks/load.py --device cpu    # the smoke CI runs: the embedded model, 2 users, 5 s

Starts the service on the GPU with a Qwen2.5-0.5B-shaped checkpoint of random weights (on the CPU the embedded
model; or --model) and runs
loadtest/locustfile.py headless (streaming /generate_stream users, the default workload mix) once per user
count. TTFT / ITL percentiles come from locust (1 ms resolution below 100 ms); token throughput from the
service's own counters (/metrics) over each run. Writes load.json and load.png to --out.
"""
import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.generate import write_checkpoint  # noqa: E402  (random Qwen2.5-0.5B-shaped bf16 weights)
from benchmarks.provenance import git_commit  # noqa: E402
from benchmarks.serve import start_server  # noqa: E402
from service.config import DEFAULT_MODEL_DIR  # noqa: E402


def token_counts(base: str) -> tuple[float, float]:
    """(prompt, generated) token counters of the service, from its /metrics text."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    return tuple(float(re.search(rf"^{name} (\S+)$", text, flags=re.M).group(1))
                 for name in ("llm_prompt_tokens_total", "llm_generation_tokens_total"))


def run_level(base: str, users: int, seconds: int, csv_prefix: Path) -> dict:
    processes = min(8, users // 16)  # locust parses every SSE event in Python: spread big loads over processes
    argv = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
            "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--stop-timeout", "120", "--host", base,
            "--csv", str(csv_prefix), "--only-summary", "GenerateStreamUser"]
    if processes > 1:
        argv[3:3] = ["--processes", str(processes)]
    before, start = token_counts(base), time.perf_counter()
    with open(f"{csv_prefix}.log", "wb") as log:
        done = subprocess.run(argv, cwd=ROOT, timeout=seconds + 300, stdout=log, stderr=subprocess.STDOUT)
    elapsed = time.perf_counter() - start
    prompted, generated = (after - b for after, b in zip(token_counts(base), before))

    stats = Path(f"{csv_prefix}_stats.csv")
    if not stats.exists():  # locust did not run (exits 1 on failed requests too, so its code alone says little)
        log_tail = Path(f"{csv_prefix}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"locust wrote no statistics (exit {done.returncode}); the end of its log:\n{log_tail}")
    with open(stats) as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    stream, ttft, itl = (rows.get((kind, "/generate_stream"), {}) for kind in ("POST", "TTFT", "ITL"))

    def ms(row, pct):
        return float(row[pct]) if row.get(pct) not in (None, "", "N/A") else float("nan")

    return {
        "users": users, "requests": int(stream.get("Request Count", 0)),
        "failures": int(stream.get("Failure Count", 0)),
        "ttft_p50_ms": ms(ttft, "50%"), "ttft_p99_ms": ms(ttft, "99%"),
        "itl_p50_ms": ms(itl, "50%"), "itl_p99_ms": ms(itl, "99%"),
        "e2e_p50_ms": ms(stream, "50%"), "e2e_p99_ms": ms(stream, "99%"),
        "output_tok_per_s": generated / elapsed, "input_tok_per_s": prompted / elapsed, "seconds": elapsed,
    }


def plot(results: list[dict], device: str, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    users = [r["users"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in ((axes[0], "ttft", "time to first token (ms)"), (axes[1], "itl", "inter-token latency (ms)")):
        for pct, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(users, [r[f"{key}_{pct}_ms"] for r in results], style, label=pct)
        ax.set_title(title)
    axes[2].plot(users, [r["output_tok_per_s"] for r in results], "o-", label="generated")
    axes[2].plot(users, [r["input_tok_per_s"] for r in results], "s--", label="prompt")
    axes[2].set_title("throughput (tokens / s)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent users")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Service under load ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--users", help="comma list of concurrent user counts (default 1,8,32,128; CPU 2)")
    parser.add_argument("--seconds", type=int, help="duration of each load level (default 30; CPU 5)")
    parser.add_argument("--model", help="checkpoint directory (default: random Qwen2.5-0.5B-shaped weights on the GPU, "
                                        "the embedded model on the CPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    args.users = args.users or ("2" if cpu else "1,8,32,128")
    args.seconds = args.seconds or (5 if cpu else 30)
    label = args.model or ("the embedded model" if cpu else "Qwen2.5-0.5B shape, random bf16 weights")
    if cpu and args.model is None:
        args.model = str(DEFAULT_MODEL_DIR)
    (args.out / "load_locust").mkdir(parents=True, exist_ok=True)
    levels = [int(u) for u in args.users.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            write_checkpoint(Path(tmp))
            model = tmp
        # the service's CLI as benchmarks/serve.py starts it (healthy, then one short stream), stopped as it stops it
        server, _ = start_server(argparse.Namespace(api_server_count=None), model, args.out / "load_service.log",
                                 {**os.environ, "LLM_DEVICE": args.device, "LLM_LOG_LEVEL": "warning"}, None, False)
        base, results = server.base_url, []
        try:
            print(f"{'users':>6} {'reqs':>6} {'fail':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
                  f"{'e2e p50':>8} {'out tok/s':>10} {'in tok/s':>10}")
            for users in levels:
                r = run_level(base, users, args.seconds, args.out / "load_locust" / f"u{users}")
                results.append(r)
                print(f"{r['users']:>6} {r['requests']:>6} {r['failures']:>5} {r['ttft_p50_ms']:>7.0f}ms "
                      f"{r['ttft_p99_ms']:>7.0f}ms {r['itl_p50_ms']:>6.0f}ms {r['itl_p99_ms']:>6.0f}ms "
                      f"{r['e2e_p50_ms']:>6.0f}ms {r['output_tok_per_s']:>10.0f} {r['input_tok_per_s']:>10.0f}",
                      flush=True)
        finally:
            server.stop()

    info = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d"), "model": label, "seconds_per_level": args.seconds,
            "endpoint": "/generate_stream", "results": results}
    (args.out / "load.json").write_text(json.dumps(info, indent=2))
    plot(results, info["device"], args.out / "load.png")
    print(f"wrote {args.out / 'load.json'} and {args.out / 'load.png'}")
    if any(r["failures"] for r in results):
        sys.exit("some requests failed: see the table and load_service.log")


if __name__ == "__main__":
    main()
