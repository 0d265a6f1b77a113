"""LoRA adapters at serving speed: a decode step with adapters in slots against one without, in one process.

python benchmarks/lora.py [--out DIR] [--rank 16] [--steps 200]
python benchmarks/lora.py --device cpu          # the smoke CI runs: the embedded model, few steps, no plot

For batch 1 / 64 / 256 and 0 / 1 / 8 distinct adapters (rows spread evenly over them; rank 16 on all 7
projections, random weights), two numbers per cell:
- graph_ms: the GPU time of one replay of the step's CUDA graph (the base graph for 0 adapters, the LoRA graph
  otherwise), CUDA events around 50 back-to-back replays;
- step_ms: the engine's wall time per step in steady decoding (overlapped scheduling: host and GPU together),
  the adapters loaded into their slots beforehand.
On the GPU the model is the Qwen2.5-0.5B-shaped random bf16 checkpoint of benchmarks/generate.py (random weights:
only times mean anything). Writes lora.json and lora.png to --out.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from service.engine.llm import LLM  # noqa: E402
from service.model.lora import Adapter, LoRAConfig, add_adapter  # noqa: E402
from service.protocol import SamplingParams  # noqa: E402

BATCHES = (1, 64, 256)
ADAPTERS = (0, 1, 8)


def load_adapters(llm: LLM, count: int, rank: int) -> list[str]:
    model = llm.engine.model
    weight = next(model.parameters())
    names = []
    for i in range(count):
        adapter = Adapter.init(model, LoRAConfig(rank=rank, alpha=2.0 * rank), seed=i)
        for _, b in adapter.weights.values():
            b.data.normal_(0, 0.01)
        add_adapter(model, f"bench-{i}", adapter.to(weight.device, weight.dtype))
        names.append(f"bench-{i}")
    return names


def start_decoding(engine, batch: int, adapters: list[str], tag: str, tokens: int) -> None:
    """`batch` requests decoding (their prefill done), spread evenly over `adapters` (none: the base model)."""
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", list(range(3, 67)), params, adapter=adapters[i % len(adapters)]
                           if adapters else None)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()


def finish(engine) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_work:
        engine.step()


def graph_ms(runner, batch: int, adapters: int, replays: int = 50) -> float | None:
    """GPU time of one replay of the decode graph that holds `batch` rows, with `adapters` slots in use."""
    import numpy as np

    from kernels.lora import lora_tiles

    key = next((bs for bs in runner.graphs if bs >= batch), None)
    if key is None:
        return None
    graph = runner.graphs[key]
    if adapters:
        row_slots = np.full(key, -1, dtype=np.int32)
        row_slots[:batch] = np.arange(batch) % adapters
        tiles = lora_tiles(row_slots, runner._lora_tiles(key))
        runner.lora_static[:len(tiles)] = torch.from_numpy(tiles).cuda()
        graph = runner.lora_graphs[key]
    for _ in range(3):
        graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / replays


def step_ms(engine, steps: int) -> float:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / steps


def measure(llm: LLM, rank: int, steps: int, batches=BATCHES, adapter_counts=ADAPTERS) -> list[dict]:
    engine = llm.engine
    names = load_adapters(llm, max(adapter_counts), rank)
    rows = []
    for batch in batches:
        for count in adapter_counts:
            start_decoding(engine, batch, names[:count], f"b{batch}-a{count}", tokens=steps + 64)
            row = {"batch": batch, "adapters": count, "step_ms": step_ms(engine, steps)}
            finish(engine)
            if engine.device.type == "cuda":
                row["graph_ms"] = graph_ms(engine.runner, batch, count)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in rows:  # against the same batch without adapters
        base = next(r for r in rows if r["batch"] == row["batch"] and r["adapters"] == 0)
        for k in ("step_ms", "graph_ms"):
            if row.get(k) is not None:
                row[f"{k[:-3]}_x"] = row[k] / base[k]
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for count in sorted({r["adapters"] for r in rows}):
        cells = [r for r in rows if r["adapters"] == count]
        ax.plot([str(r["batch"]) for r in cells], [r.get("graph_ms") or r["step_ms"] for r in cells], marker="o",
                label=f"{count} adapters" if count else "base model")
    ax.set_xlabel("decode batch")
    ax.set_ylabel("graph replay (ms)")
    ax.set_title("Decode step with LoRA adapters in slots (rank 16, all projections)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, help="steps timed per cell (default 200; CPU 3)")
    args = p.parse_args(argv)
    if args.device == "cpu":
        llm = LLM(None, device="cpu", max_loras=8, max_lora_rank=args.rank)
        rows = measure(llm, args.rank, args.steps or 3, batches=(1, 4), adapter_counts=(0, 1, 2))
    else:
        from benchmarks.generate import write_checkpoint
        tmp = Path(tempfile.mkdtemp())
        write_checkpoint(tmp)
        llm = LLM(str(tmp), dtype="bfloat16", gpu_memory_utilization=0.6, max_model_len=4096, max_loras=8,
                  max_lora_rank=args.rank)
        rows = measure(llm, args.rank, args.steps or 200)
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                               capture_output=True, text=True).stdout.strip()
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "commit": commit,
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rank": args.rank,
              "weights": "random (Qwen2.5-0.5B shape on the GPU): times only", "decode": rows}
    print(f"{'batch':>6} {'adapters':>9} {'step ms':>9} {'x base':>7} {'graph ms':>9} {'x base':>7}")
    for r in rows:
        graph = f"{r['graph_ms']:9.3f} {r['graph_x']:7.2f}" if r.get("graph_ms") else f"{'-':>9} {'-':>7}"
        print(f"{r['batch']:>6} {r['adapters']:>9} {r['step_ms']:9.3f} {r['step_x']:7.2f} {graph}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora.json").write_text(json.dumps(result, indent=1))
    if args.device == "cuda":
        plot(rows, args.out / "lora.png")


if __name__ == "__main__":
    main()
