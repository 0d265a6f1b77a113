"""LoRA adapters at serving speed: a decode step with adapters in slots against one without, in one process; and
the service over HTTP with a share of its requests naming adapters (--served).

python benchmarks/lora.py [--out DIR] [--rank 16] [--steps 200]
python benchmarks/lora.py --device cpu          # the smoke CI runs: the embedded model, few steps, no plot
python benchmarks/lora.py --served [--out DIR]  # the served part only
python benchmarks/lora.py --served --device cpu # its smoke: the embedded model, 4 streams, seconds each phase

For batch 1 / 64 / 256 and 0 / 1 / 8 distinct adapters (rows spread evenly over them; rank 16 on all 7
projections, random weights), and at 64 and 256 rows 8 adapters on 5% of the rows only (3 / 13, the others on the
base model: the steps of the served 5% phase), two numbers per cell:
- graph_ms: the GPU time of one replay of the step's CUDA graph (the base graph for 0 adapters, the LoRA graph
  otherwise), CUDA events around 50 back-to-back replays;
- step_ms: the engine's wall time per step in steady decoding (overlapped scheduling: host and GPU together),
  the adapters loaded into their slots beforehand;
and kernel_us: the GPU microseconds per replay of that graph's 24 costliest kernels (benchmarks/timing.py).
The cells on 5% of the rows also hold `no_pdl`: the base and the LoRA graph captured again without programmatic
dependent launch (kernels/configs.py's PDL), their graph_ms and kernel_us: with PDL a kernel's time includes its
wait on the one before, so the kernels' differences between the two graphs say where the adapters' time goes only
without it.
With adapters also `variants`: the graph_ms of the same graph captured again, as shipped and with kernels/lora.py's
switches set otherwise (VARIANTS): o's updates from its own launches (a shrink, then decode_linear's expands up to
16 rows) rather than in the residual add after it; every update added after the GEMMs by kernels.lora.lora_add_, as
steps of 17-64 rows ran before the slots' columns; q/k/v's and gate-up's shrinks (and o's, from the attention's
merge) from their producers up to 256 rows, not 64 (past them a lora_shrink launch each); and the shrinks past those
rows from lora_shrink launches rather than tiles of one slot's rows (TILE_SHRINK_MIN_ROWS), or tiles past 16, or
tiles whose programs take K in chunks even where one takes all of it (TILE_WHOLE_K); at
batch 1 only o's switch applies. `variants_x` compares each with the shipped graph captured again beside it. (Every
graph is timed after kernels/pdl_primer.py's launch, as the engine replays it: before that primer graphs timed right
after engine steps read slower than after a capture, 1.10 against 1.02 ms for the base graph of 64 rows on an H200 at
c28a8ee, and this benchmark's graph_ms up to 84e2744 were the slow ones.)
On the GPU the model is the Qwen2.5-0.5B-shaped random bf16 checkpoint of benchmarks/generate.py (random weights:
only times mean anything).

--served: one server (the CLI, benchmarks/serve.py's start) serving 8 random PEFT adapters (rank 16 on all 7
projections, --lora-modules), and on it, one phase after another, 64 closed-loop streams on /generate_stream
(benchmarks/load_generator.py; serve.py's GPU workload: 128-token prompts, 256 new tokens) in rounds where 0%, 5% and
50% of requests name an adapter (drawn at random among the 8), then 0% once more (two rounds on the GPU: 0, 5, 50, 0,
5, 50, 0): tok/s, TTFT and ITL p50/p99 of each phase and its ratios to the mean of the 0% phases around its round
(the server's own speed drifts by as much as the targets measure: base_drift, the last 0% phase over the first),
`shares`: each share's ratios averaged over the rounds, and the issue's targets on those (5%: ITL p50 <= 1.15x and
tok/s >= 0.9x; 50%: tok/s >= 0.75x). Each phase's `steps`: the engine's steps in its measuring
window by how they ran (service/metrics.py's llm_engine_steps: decode or prefill graph, or eager, with adapters from
slots or none), each kind's share and mean wall ms: where a phase's time went between kinds of step.

Writes lora.json (the part run updates its key, "decode" or "served"; the other stays) and lora.png to --out.
"""
import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.provenance import git_commit  # noqa: E402
from benchmarks.timing import replay_kernel_us, replay_ms, synchronize  # noqa: E402
from kernels.decode_linear import MAX_ROWS  # noqa: E402
from kernels.lora import ROW_SHRINK_MAX_ROWS  # noqa: E402
from service.engine.llm import LLM  # noqa: E402
from service.model.lora import TARGETS, Adapter, LoRAConfig, add_adapter  # noqa: E402
from service.protocol import SamplingParams  # noqa: E402

BATCHES = (1, 64, 256)
ADAPTERS = (0, 1, 8)
# A further cell per batch: the most adapters on this share of its rows only (the served phase of 5%: a few rows of
# the step on adapters, the others on the base model, all through the LoRA graph).
FEW_ROWS_SHARE = 0.05
# A round: the phase without adapters, then these shares; after the last round the base once more. A phase's ratios
# divide by the mean of the base phases on either side of its round: the server's own speed moved 7-8% between the
# first and the last base phase of one run (H200, 1e2fc83 and 27593de), as much as the targets measure.
SERVED_ADAPTERS, SERVED_ROUND = 8, (0.05, 0.5)
# Per phase: closed-loop streams, prompt and generated tokens, then seconds of warm-up, measuring window and drain;
# and the rounds of phases.
SERVED = {"cuda": {"streams": 64, "prompt_len": 128, "new_tokens": 256, "warmup": 3.0, "seconds": 12.0, "drain": 10.0,
                   "rounds": 2},
          "cpu": {"streams": 4, "prompt_len": 16, "new_tokens": 16, "warmup": 1.0, "seconds": 3.0, "drain": 20.0,
                  "rounds": 1}}
RATIO_KEYS = ("tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
# Graphs captured again with kernels/lora.py's switches set otherwise (see the doc); decode rows take the first two.
VARIANTS = {"as_shipped": {}, "o_own_launches": {"UPDATE_IN_NORM_MAX_ROWS": 0},
            "updates_after_gemms": {"COLUMNS_MAX_ROWS": 0},
            "shrinks_in_norms_to_256_rows": {"ROW_SHRINK_MAX_ROWS": 256},
            "no_tile_shrinks": {"TILE_SHRINK_MIN_ROWS": 0},
            "tile_shrinks_past_16_rows": {"TILE_SHRINK_MIN_ROWS": 17},
            "tiles_in_k_chunks": {"TILE_WHOLE_K": 0}}
# Those whose switches act only past the norms' rows (kernels.lora.ROW_SHRINK_MAX_ROWS, where the tiles start): not
# captured again at fewer rows, where they would time the shipped graph (a capture each of device time).
PAST_NORM_ROWS = {"shrinks_in_norms_to_256_rows", "no_tile_shrinks", "tiles_in_k_chunks"}
STEPS_EVERY = 0.5  # seconds between the served phases' readings of the engine's steps from /metrics
TARGETS_X = {0.05: {"itl_p50_x": 1.15, "tok_per_s_x": 0.9}, 0.5: {"tok_per_s_x": 0.75}}  # issue 31; tok/s: minimum


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


def start_decoding(engine, batch: int, adapters: list[str], tag: str, tokens: int, adapter_rows: int) -> None:
    """`batch` requests decoding (their prefill done), the first `adapter_rows` spread evenly over `adapters`, the
    others on the base model."""
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", list(range(3, 67)), params, adapter=adapters[i % len(adapters)]
                           if i < adapter_rows else None)
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


def decode_graph(runner, batch: int, adapters: int, adapter_rows: int):
    """The decode graph that holds `batch` rows (None: none does), its first `adapter_rows` over `adapters` slots."""
    import numpy as np

    from kernels.lora import lora_tiles

    key = next((bs for bs in runner.graphs if bs >= batch), None)
    if key is None:
        return None
    graph = runner.graphs[key]
    if adapters:
        row_slots = np.full(key, -1, dtype=np.int32)
        row_slots[:adapter_rows] = np.arange(adapter_rows) % adapters
        tiles = lora_tiles(row_slots, runner._lora_tiles(key))
        runner.lora_static[:len(tiles)] = torch.from_numpy(tiles).cuda()
        graph = runner.lora_graphs[key]
    return graph


def variant_graph(runner, batch: int, switches: dict):
    """The LoRA decode graph that holds `batch` rows, captured again with kernels/lora.py's `switches` set."""
    from unittest import mock

    import kernels.lora

    key = next(bs for bs in runner.graphs if bs >= batch)
    with mock.patch.multiple(kernels.lora, **switches) if switches else contextlib.nullcontext():
        return runner._capture(runner._decode_forward(key), lora_rows=key)[0]


def no_pdl_graphs(runner, batch: int) -> dict:
    """The base and the LoRA decode graph that hold `batch` rows, captured again without programmatic dependent
    launch: graph_ms and kernel_us of each (the doc's `no_pdl`)."""
    from unittest import mock

    import kernels.configs

    key = next(bs for bs in runner.graphs if bs >= batch)
    with mock.patch.object(kernels.configs, "PDL", False):
        graphs = {"base": runner._capture(runner._decode_forward(key))[0],
                  "lora": runner._capture(runner._decode_forward(key), lora_rows=key)[0]}
    return {"graph_ms": {name: replay_ms(g) for name, g in graphs.items()},
            "kernel_us": {name: replay_kernel_us(g, top=24) for name, g in graphs.items()}}


def variants_at(batch: int) -> list[str]:
    """The VARIANTS a LoRA graph of `batch` rows is captured again with: decode rows' take o's switch only, and up to
    the norms' rows none of PAST_NORM_ROWS."""
    return [name for name in list(VARIANTS)[:None if batch > MAX_ROWS else 2]
            if batch > ROW_SHRINK_MAX_ROWS or name not in PAST_NORM_ROWS]


def step_ms(engine, steps: int) -> float:
    synchronize(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(engine.device)
    return 1e3 * (time.perf_counter() - start) / steps


def measure(llm: LLM, rank: int, steps: int, batches=BATCHES, adapter_counts=ADAPTERS) -> list[dict]:
    engine = llm.engine
    names = load_adapters(llm, max(adapter_counts), rank)
    rows = []
    for batch in batches:
        cells = [(count, batch if count else 0) for count in adapter_counts]
        few = max(1, round(FEW_ROWS_SHARE * batch))
        if few < batch:
            cells.append((max(adapter_counts), few))
        for count, adapter_rows in cells:
            start_decoding(engine, batch, names[:count], f"b{batch}-a{count}-r{adapter_rows}", steps + 64, adapter_rows)
            row = {"batch": batch, "adapters": count, "adapter_rows": adapter_rows, "step_ms": step_ms(engine, steps)}
            finish(engine)
            graph = decode_graph(engine.runner, batch, count, adapter_rows) if engine.device.type == "cuda" else None
            if graph is not None:
                row["graph_ms"] = replay_ms(graph)
                # where the adapters' time goes: to decode_linear's rows, past them in the columns, past the norms'
                row["kernel_us"] = replay_kernel_us(graph, top=24)
                if count:
                    row["variants"] = {name: replay_ms(variant_graph(engine.runner, batch, VARIANTS[name]))
                                       for name in variants_at(batch)}
                if count and adapter_rows < batch:
                    row["no_pdl"] = no_pdl_graphs(engine.runner, batch)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in rows:  # against the same batch without adapters
        base = next(r for r in rows if r["batch"] == row["batch"] and r["adapters"] == 0)
        for k in ("step_ms", "graph_ms"):
            if row.get(k) is not None:
                row[f"{k[:-3]}_x"] = row[k] / base[k]
        if "variants" in row:
            row["variants_x"] = {name: ms / row["variants"]["as_shipped"] for name, ms in row["variants"].items()}
    return rows


def write_peft_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[str]:
    """`count` random LoRA adapters (rank `rank`, every projection of every layer) of the checkpoint at model_dir,
    in PEFT's layout (adapter_config.json and adapter_model.safetensors, as PeftModel.save_pretrained writes them);
    returns their --lora-modules entries, name=path."""
    from safetensors.torch import save_file

    c = json.loads((model_dir / "config.json").read_text())
    hidden, inner = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
              "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inner), "mlp.up_proj": (hidden, inner),
              "mlp.down_proj": (inner, hidden)}  # (in, out) features
    assert {m.rsplit(".", 1)[1] for m in shapes} == set(TARGETS)
    modules = []
    for i in range(count):
        generator = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(c["num_hidden_layers"]):
            for module, (n_in, n_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) / n_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(n_out, rank, generator=generator)
        path = out / f"lora-{i}"
        path.mkdir(parents=True)
        save_file({k: t.to(torch.bfloat16) for k, t in tensors.items()}, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                  "base_model_name_or_path": str(model_dir)}
        (path / "adapter_config.json").write_text(json.dumps(config))
        modules.append(f"lora-{i}={path}")
    return modules


def engine_steps(base_url: str) -> dict[str, list[float]]:
    """The engine's steps so far and their summed seconds, by how the runner ran them ("kind/adapters": the labels
    of llm_engine_steps, service/metrics.py), summed over engine cores."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    columns = {"llm_engine_steps_total": 0, "llm_engine_step_time_seconds_total": 1}
    steps: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in columns:
                totals = steps.setdefault(f"{sample.labels['kind']}/{sample.labels['adapters']}", [0.0, 0.0])
                totals[columns[sample.name]] += sample.value
    return steps


def steps_between(before: dict, after: dict) -> dict:
    """Per "kind/adapters" that ran between two engine_steps(): steps, their share of all, and mean ms."""
    moved = {key: [now - then for now, then in zip(after[key], before.get(key, (0.0, 0.0)))] for key in after}
    total = sum(n for n, _ in moved.values()) or 1
    return {key: {"steps": int(n), "share": n / total, "mean_ms": 1e3 * seconds / n}
            for key, (n, seconds) in sorted(moved.items()) if n > 0}


def served_phase(server, words: list[str], n_words: int, names: list[str], share: float, cfg: dict,
                 seed: int) -> dict:
    """One phase: cfg's closed-loop streams on /generate_stream, each request naming one of `names` with
    probability `share`; summarize()'s numbers, TTFT/ITL of the requests that named one, and the engine's steps
    in the measuring window by how they ran (/metrics read every STEPS_EVERY seconds through the phase, the window
    taken between the last readings at or before its start and its end: the window opens only once the load
    generator's processes have started)."""
    from benchmarks.load_generator import TGI, Level, Workload, run_level, summarize

    workload = Workload(server.base_url, TGI, words, n_words, cfg["new_tokens"], ignore_eos=True,
                        adapters=tuple(names), adapter_share=share)
    readings: list[tuple[float, dict]] = []
    failures: list[str] = []
    done = threading.Event()

    def read_steps():  # kept beside the row: a thread's exception would only reach stderr
        while not done.is_set():
            try:
                readings.append((time.monotonic(), engine_steps(server.base_url)))
            except Exception as error:
                failures.append(repr(error))
            done.wait(STEPS_EVERY)

    reader = threading.Thread(target=read_steps, daemon=True)
    reader.start()
    level = run_level(workload, concurrency=cfg["streams"], processes=max(1, min(8, (os.cpu_count() or 2) // 2)),
                      warmup=cfg["warmup"], seconds=cfg["seconds"], drain=cfg["drain"], seed=seed)
    done.set()
    reader.join()
    row = {"adapter_share": share, **summarize(level), "steps": {}}
    bounds = [[steps for at, steps in readings if at <= edge][-1:] for edge in level.window]
    if all(bounds):
        row["steps"] = steps_between(bounds[0][0], bounds[1][0])
    if not row["steps"]:
        row["steps_error"] = failures[0] if failures else f"{len(readings)} readings, none moved across the window"
    w0, w1 = level.window
    named = [r for r in level.records if r.adapter and w0 <= r.start < w1]
    row["adapter_requests"] = len(named)
    if named:
        latencies = summarize(Level(named, level.window, level.cpu_util))
        row["named_adapter"] = {k: latencies[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}
    print(f"served, {share:4.0%} naming adapters: {row['tok_per_s']:8.0f} tok/s  TTFT p50 {row['ttft_p50_ms']:.0f} "
          f"p99 {row['ttft_p99_ms']:.0f} ms  ITL p50 {row['itl_p50_ms']:.2f} p99 {row['itl_p99_ms']:.2f} ms  "
          f"{row['requests']} requests ({len(named)} named one)  {row['errors']} errors", flush=True)
    print("  steps: " + ", ".join(f"{key} {s['share']:.0%} {s['mean_ms']:.2f} ms" for key, s in row["steps"].items())
          + (f" (not read: {row['steps_error']})" if "steps_error" in row else ""), flush=True)
    return row


def served(device: str, rank: int, out: Path) -> dict:
    """The served phases (cfg's rounds of the base and SERVED_ROUND, then the base) on one server; see the module's
    docstring."""
    from benchmarks.serve import _post, prompt_words, start_server, write_model
    from service.config import DEFAULT_MODEL_DIR

    cfg = SERVED[device]
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    try:
        model_dir = None if device == "cpu" else tmp / "model"
        if model_dir is not None:
            write_model(model_dir)
        modules = write_peft_adapters(Path(model_dir or DEFAULT_MODEL_DIR), tmp / "adapters", SERVED_ADAPTERS, rank)
        names = [m.split("=", 1)[0] for m in modules]
        env = {**os.environ, "LLM_DEVICE": device, "LLM_LOG_LEVEL": "info", "LLM_FINETUNE_DIR": str(tmp / "ft"),
               "LLM_LORA_MODULES": json.dumps(modules), "LLM_MAX_LORAS": str(SERVED_ADAPTERS),
               "LLM_MAX_LORA_RANK": str(rank)}
        if device == "cpu":  # one torch thread: steadier steps beside the load generator on few cores (serve.py)
            env["OMP_NUM_THREADS"] = "1"
        words, n_words, prompt_tokens = prompt_words(model_dir and str(model_dir), cfg["prompt_len"])
        server, startup = start_server(argparse.Namespace(api_server_count=None), model_dir and str(model_dir),
                                       out / "lora_server.log", env, None, False)
        try:
            for name in names:  # each adapter once before anything is measured: served, and in its slot
                body = {"inputs": "w1 w2 w3", "parameters": {"max_new_tokens": 2, "adapter_id": name}}
                with _post(f"{server.base_url}/generate", body) as response:
                    response.read()
            plan = [share for _ in range(cfg["rounds"]) for share in (0.0, *SERVED_ROUND)] + [0.0]
            rows = [served_phase(server, words, n_words, names, share, cfg, seed)
                    for seed, share in enumerate(plan)]
        finally:
            server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shares = phase_ratios(rows)
    bases = [row for row in rows if row["adapter_share"] == 0.0]
    drift = {key: bases[-1][key] / bases[0][key] if bases[0][key] else None for key in RATIO_KEYS}
    targets = []
    for share, limits in TARGETS_X.items():
        row = next(r for r in shares if r["adapter_share"] == share)
        met = all(row[k] is not None and (row[k] >= v if k == "tok_per_s_x" else row[k] <= v)
                  for k, v in limits.items())
        targets.append({"adapter_share": share, **limits, "met": met})
    return {"adapters": SERVED_ADAPTERS, "rank": rank, "modules": "all 7 projections, every layer; PEFT layout",
            "endpoint": "/generate_stream", "prompt_tokens": prompt_tokens, **cfg, "startup_s": startup,
            "phases": rows, "shares": shares, "base_drift": drift, "issue_targets": targets}


def phase_ratios(rows: list[dict]) -> list[dict]:
    """Sets each phase's ratios (`<key>_x`): a base phase (share 0) against the mean of all base phases, any other
    against the mean of the base phases just before and after its round. Returns each adapter share's ratios
    averaged over its rounds (and each round's, `<key>_x_rounds`)."""
    def x(value, base):
        return value / base if base else None

    at = [i for i, row in enumerate(rows) if row["adapter_share"] == 0.0]
    for key in RATIO_KEYS:
        mean = sum(rows[i][key] for i in at) / len(at)
        for i, row in enumerate(rows):
            before = max(j for j in at if j <= i)
            after = min((j for j in at if j >= i), default=before)
            around = mean if row["adapter_share"] == 0.0 else (rows[before][key] + rows[after][key]) / 2
            row[f"{key.removesuffix('_ms')}_x"] = x(row[key], around)
    shares = []
    for share in dict.fromkeys(row["adapter_share"] for row in rows if row["adapter_share"]):
        mine = [row for row in rows if row["adapter_share"] == share]
        entry = {"adapter_share": share, "rounds": len(mine)}
        for key in (k.removesuffix("_ms") + "_x" for k in RATIO_KEYS):
            values = [row[key] for row in mine]
            entry[key] = None if None in values else sum(values) / len(values)
            entry[f"{key}_rounds"] = values
        shares.append(entry)
    return shares


def plot(result: dict, path: Path) -> None:
    """The decode steps (graph replay, or the step's wall time without CUDA) beside the served phases' ratios."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [k for k in ("decode", "served") if k in result]
    fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 4), squeeze=False)
    for ax, part in zip(axes[0], parts):
        if part == "decode":
            rows = result["decode"]
            for count, few in sorted({(r["adapters"], _few(r)) for r in rows}):
                cells = [r for r in rows if (r["adapters"], _few(r)) == (count, few)]
                label = (f"{count} adapters" + (f" on {FEW_ROWS_SHARE:.0%} of the rows" if few else "")) if count \
                    else "base model"
                ax.plot([str(r["batch"]) for r in cells], [r.get("graph_ms") or r["step_ms"] for r in cells],
                        marker="o", linestyle="--" if few else "-", label=label)
            ax.set_xlabel("decode batch")
            ax.set_ylabel("graph replay (ms)")
            ax.set_title("Decode step with LoRA adapters in slots (rank 16, all projections)")
        else:
            run = result["served"]
            keys = ("tok_per_s_x", "ttft_p50_x", "itl_p50_x", "itl_p99_x")
            bars = [(f"no adapter, phase {i + 1}", row) for i, row in enumerate(run["phases"])
                    if row["adapter_share"] == 0.0]
            bars += [(f"{row['adapter_share']:.0%} of requests name an adapter"
                      + (f" (mean of {row['rounds']} rounds)" if row["rounds"] > 1 else ""), row)
                     for row in run.get("shares", [])]
            width = 0.8 / len(bars)
            for i, (label, row) in enumerate(bars):
                ax.bar([x + i * width for x in range(len(keys))], [row[k] or 0 for k in keys], width, label=label)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))], ["tok/s", "TTFT p50", "ITL p50", "ITL p99"])
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_ylabel("x the phases without adapters around them")
            ax.set_title(f"Served, {result['served']['streams']} streams, {result['served']['adapters']} adapters")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _few(row: dict) -> bool:
    """Whether a decode cell has only some of its rows on adapters (rows from before that cell had them all)."""
    return 0 < row.get("adapter_rows", row["batch"]) < row["batch"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, help="steps timed per cell (default 200; CPU 3)")
    p.add_argument("--served", action="store_true", help="the served part only (over HTTP), not the decode steps")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "lora.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    commit = git_commit()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.served:
        result["served"] = {"device": device, "commit": commit, "date": time.strftime("%Y-%m-%d"),
                            **served(args.device, args.rank, args.out)}
        print_served(result["served"])
    else:
        result |= decode(args, device, commit)
    path.write_text(json.dumps(result, indent=1))
    if args.device == "cuda" or args.served:
        plot(result, args.out / "lora.png")


def decode(args, device: str, commit: str) -> dict:
    if args.device == "cpu":
        llm = LLM(None, device="cpu", max_loras=8, max_lora_rank=args.rank)
        rows = measure(llm, args.rank, args.steps or 3, batches=(1, 4), adapter_counts=(0, 1, 2))
    else:
        from benchmarks.generate import write_checkpoint
        tmp = Path(tempfile.mkdtemp())
        try:
            write_checkpoint(tmp)
            llm = LLM(str(tmp), dtype="bfloat16", gpu_memory_utilization=0.6, max_model_len=4096, max_loras=8,
                      max_lora_rank=args.rank)
            rows = measure(llm, args.rank, args.steps or 200)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'batch':>6} {'adapters':>9} {'on rows':>8} {'step ms':>9} {'x base':>7} {'graph ms':>9} {'x base':>7}")
    for r in rows:
        graph = f"{r['graph_ms']:9.3f} {r['graph_x']:7.2f}" if r.get("graph_ms") else f"{'-':>9} {'-':>7}"
        print(f"{r['batch']:>6} {r['adapters']:>9} {r['adapter_rows']:>8} {r['step_ms']:9.3f} {r['step_x']:7.2f} "
              f"{graph}")
    for r in rows:
        for name, ms in r.get("variants", {}).items():
            print(f"batch {r['batch']}, {r['adapters']} adapters, {name}: graph {ms:.3f} ms = "
                  f"{r['variants_x'][name]:.2f}x as shipped (captured again)")
    for r in rows:
        if "no_pdl" in r:
            ms, us = r["no_pdl"]["graph_ms"], r["no_pdl"]["kernel_us"]
            delta = {k: round(us["lora"].get(k, 0.0) - us["base"].get(k, 0.0), 1) for k in us["lora"] | us["base"]}
            print(f"batch {r['batch']}, {r['adapters']} adapters on {r['adapter_rows']} rows, without PDL: graph "
                  f"{ms['lora']:.3f} ms against {ms['base']:.3f} ({ms['lora'] / ms['base']:.2f}x); GPU us per replay, "
                  f"LoRA graph less base, by kernel: {json.dumps(dict(sorted(delta.items(), key=lambda kv: -kv[1])))}")
    for r in rows:
        if "kernel_us" in r:
            kernels = json.dumps({k: round(v, 1) for k, v in r["kernel_us"].items()})
            print(f"batch {r['batch']}, {r['adapters']} adapters on {r['adapter_rows']} rows, GPU us per replay by "
                  f"kernel: {kernels}")
    return {"device": device, "commit": commit, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "rank": args.rank, "weights": "random (Qwen2.5-0.5B shape on the GPU): times only", "decode": rows}


def print_served(served: dict) -> None:
    print(f"\n{'adapters':>9} {'tok/s':>8} {'x':>5} {'TTFT p50':>9} {'p99':>6} {'ITL p50':>8} {'x':>5} {'p99':>6} "
          f"{'x':>5} {'reqs':>5} {'named':>5} {'err':>4}")
    for r in served["phases"]:
        print(f"{r['adapter_share']:>9.0%} {r['tok_per_s']:8.0f} {r['tok_per_s_x']:5.2f} {r['ttft_p50_ms']:9.0f} "
              f"{r['ttft_p99_ms']:6.0f} {r['itl_p50_ms']:8.2f} {r['itl_p50_x']:5.2f} {r['itl_p99_ms']:6.2f} "
              f"{r['itl_p99_x']:5.2f} {r['requests']:>5} {r['adapter_requests']:>5} {r['errors']:>4}")
    for r in served["shares"]:
        print(f"{r['adapter_share']:.0%} naming adapters over {r['rounds']} round(s): tok/s {r['tok_per_s_x']:.2f}x "
              f"({', '.join(f'{v:.2f}' for v in r['tok_per_s_x_rounds'])}), ITL p50 {r['itl_p50_x']:.2f}x "
              f"({', '.join(f'{v:.2f}' for v in r['itl_p50_x_rounds'])})")
    drift = served["base_drift"]
    print(f"the phase without adapters, last against first: tok/s {drift['tok_per_s']:.2f}x, "
          f"ITL p50 {drift['itl_p50_ms']:.2f}x")
    for t in served["issue_targets"]:
        limits = ", ".join(f"{k} {'>=' if k == 'tok_per_s_x' else '<='} {v}" for k, v in t.items()
                           if k.endswith("_x"))
        print(f"{t['adapter_share']:.0%} naming adapters: {limits}: {'met' if t['met'] else 'MISSED'}")
    if any(r["errors"] for r in served["phases"]):
        sys.exit("some requests failed: see first_error in lora.json and lora_server.log")


if __name__ == "__main__":
    main()
