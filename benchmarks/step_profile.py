"""Where an engine step's host time goes. Prefill (the time to first token): an eager step's wall time against
its GPU time, the host time of one call of our varlen attention, the host ops that cost most (torch.profiler),
and the engine's own time to first token (add_request to the first sampled token, prefill graphs included) with
where its host time goes. Decode: the wall time of overlapped steps at a few batch sizes and the Python functions
that cost most (cProfile), to set against the decode graph's GPU time, and both again without the engine's PDL
primer (kernels/pdl_primer.py: decode_profile); and at batch 64 with 3 sequences on a LoRA adapter.

Decode graphs (--sections graphs): for the Qwen2.5-0.5B and Llama-3.2-1B shapes, the kernels a decode step
launches (per step and per layer) and the GPU time of one replay of its CUDA graph at batch 1 / 8 / 64 / 256 with a
512-token context, on the fused path (service/model/layers.py) and the module-by-module one, in one process, beside
the floor (the weights' bytes read once at 3 TB/s). --sections linear: kernels/decode_linear.py's configurations
against cuBLAS on each projection of both shapes at 1, 16 and 64 rows (the model takes it up to 16); --sections
lora: kernels/lora.py's (the LoRA updates of larger steps) at 64 and 256 rows over 8 adapters; --sections
decode_lora: decode_linear with its rows' LoRA slots against without, each projection of the Qwen2.5-0.5B shape at
1, 16 and 64 rows (64: whether decode_linear with the expands inside would beat cuBLAS + lora_add_ there);
--sections lora_producers: the launches that compute the shrinks in LoRA steps of 64 and 256 rows (the norms, the
SwiGLU gate, o's input), each alone beside the base step's launch.

python benchmarks/step_profile.py [--tokens 128] [--out DIR]
    [--sections prefill,decode,graphs,linear,lora,decode_lora,lora_producers]
python benchmarks/step_profile.py --device cpu  # the smoke CI runs

Random bf16 checkpoints in the models' shapes (benchmarks/generate.py): only times mean anything. Writes
step_profile.json (and step_profile.png, the graphs section's).

--device cpu runs the same sections on benchmarks/generate.py's tiny Qwen2 (TINY_CONFIG) in float32, Triton's
kernels in its interpreter (TRITON_INTERPRET=1): the prefill of 16-token prompts, decode steps at batch 1 and 4, the
sweeps on that shape's projections (lora at 16 rows, decode_lora at 1 and 4, lora_producers at 20 and 72 rows, past
the norms' 64 the tiles; over 2 adapters), each sweep cell the wall clock of one eager call (cublas_us: torch's
linear on the CPU). What needs CUDA (the graphs section, GPU times, graph replays) is recorded as skipped with
why. Its numbers only show that the path runs (CI: tests/test_step_profile_benchmark.py).
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bar_chart import grouped_bars  # noqa: E402
from benchmarks.generate import CONFIG, LLAMA_1B_CONFIG, TINY_CONFIG, write_checkpoint  # noqa: E402
from benchmarks.provenance import git_commit  # noqa: E402
from benchmarks.timing import kernel_us, replay_ms, synchronize, wall_ms  # noqa: E402
from service.engine.llm import LLM  # noqa: E402
from service.protocol import SamplingParams  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, help="the prefill's prompt tokens (default 128; CPU 16)")
    parser.add_argument("--sections", default="prefill,decode,graphs,linear,lora,decode_lora,lora_producers")
    parser.add_argument("--paths", default=",".join(p for p, *_ in PATHS), help="the graphs section's paths")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    setup = SETUPS[args.device] | {"device": torch.device(args.device)}
    cuda = args.device == "cuda"
    if not cuda:  # one torch thread: the tiny model gains nothing from more, and beside another busy process on
        torch.set_num_threads(1)  # 2 cores their waits on each other made a 1.5 ms prefill step take 200 ms
    result = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "commit": git_commit(),
              "date": time.strftime("%Y-%m-%d"), "weights": setup["weights"]}
    if "linear" in sections:
        result["linear"] = sweep_linear(setup)
    if "lora" in sections:
        result["lora"] = sweep_lora(setup)
    if "decode_lora" in sections:
        result["decode_lora"] = sweep_decode_lora(setup)
    if "lora_producers" in sections:
        result["lora_producers"] = sweep_lora_producers(setup)
    if "graphs" in sections and not cuda:
        result["graphs"] = CPU_SKIPS["graphs"]
    elif "graphs" in sections:
        result["graphs"] = {name: decode_graphs(config, args.paths.split(",")) for name, config in SHAPES.items()}
        print_graphs(result["graphs"])
        args.out.mkdir(parents=True, exist_ok=True)
        plot_graphs(result["graphs"], args.out / "step_profile.png")
    if sections & {"prefill", "decode"}:
        result |= prefill_and_decode(args.tokens or setup["tokens"], setup)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_profile.json").write_text(json.dumps(result, indent=1))


def prefill_and_decode(n: int, setup: dict) -> dict:
    device, cuda = setup["device"], setup["device"].type == "cuda"
    tmp = Path(tempfile.mkdtemp())
    write_checkpoint(tmp, setup["checkpoint"], device.type)
    llm = LLM(str(tmp), device=device.type, dtype=setup["dtype"], gpu_memory_utilization=0.5, max_model_len=4096)
    runner, model = llm.engine.runner, llm.engine.model
    tables = [list(range(-(-n // runner.block_size)))]

    @torch.inference_mode()
    def step():
        ids, positions, meta, _ = runner._inputs(list(range(3, n + 3)), [n], [n], tables)
        model.compute_logits(model(ids, positions, meta)[-1:]).argmax(-1).tolist()

    step()
    wall = wall_ms(step, reps=setup["repeat"], warmup=0, device=device)

    from kernels import flash_attn_varlen_func
    attn = model.model.layers[0].self_attn
    with torch.inference_mode():
        ids, positions, meta, _ = runner._inputs(list(range(3, n + 3)), [n], [n], tables)
        q = torch.randn(n, attn.num_heads, attn.head_dim, device=device, dtype=getattr(torch, setup["dtype"]))
        call = lambda: flash_attn_varlen_func(q, attn.k_cache, attn.v_cache, meta.cu_seqlens_q,  # noqa: E731
                                              meta.cu_seqlens_k, n, n, softmax_scale=attn.scale, causal=True,
                                              block_table=meta.block_table)
        call()
        host = []
        for _ in range(setup["attention_calls"]):
            t = time.perf_counter()
            call()
            host.append(time.perf_counter() - t)
        attention_host_us = 1e6 * sorted(host)[len(host) // 2]
        attention_ms = wall_ms(call, reps=setup["repeat"], warmup=0, device=device)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
    averages = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in averages) / 5 / 1e3 if cuda else CPU_SKIPS["step_gpu_ms"]
    table = averages.table(sort_by="self_cpu_time_total", row_limit=25)
    result = {"tokens": n, "layers": model.config.num_hidden_layers, "step_wall_ms": wall, "step_gpu_ms": gpu_ms,
              "attention_call_host_us": attention_host_us, "attention_call_wall_ms": attention_ms}
    result |= engine_ttft(llm, n, setup["ttft_requests"])
    steps = setup["decode_steps"]
    decode = {batch: decode_profile(llm, batch, steps) for batch in setup["decode_batches"]}
    result["decode_step_ms_with_adapter"] = lora_decode_step_ms(llm, *setup["adapter_batch"], steps)
    print(table)
    for batch, d in decode.items():
        graph = (f" ({d['step_ms_without_primer']:.3f} without the PDL primer); its graph after steps "
                 f"{d['graph_ms']['primed']:.3f} ms primed, {d['graph_ms']['without_primer']:.3f} without" if cuda
                 else "")
        print(f"decode batch {batch}: {d['step_ms']:.3f} ms per step{graph}\n{d['profile']}")
    result["decode_step_ms"] = {batch: d["step_ms"] for batch, d in decode.items()}
    if cuda:
        result["decode_step_ms_without_primer"] = {batch: d["step_ms_without_primer"] for batch, d in decode.items()}
    result["decode_graph_ms"] = ({batch: d["graph_ms"] for batch, d in decode.items()} if cuda
                                 else CPU_SKIPS["decode_graph_ms"])
    print(json.dumps(result, indent=1))
    del llm
    torch.cuda.empty_cache()
    shutil.rmtree(tmp, ignore_errors=True)
    return {**result, "prefill_profile": table, "decode_profiles": {b: d["profile"] for b, d in decode.items()}}


SHAPES = {"Qwen2.5-0.5B": CONFIG, "Llama-3.2-1B": LLAMA_1B_CONFIG}
GRAPH_BATCHES = (1, 8, 64, 256)
CONTEXT = 512
COPY_BYTES_PER_S = 3.0e12  # device-to-device copy on the H100 (../shared/device/README.md)


def prime_decode_rows(runner, batch: int, context: int) -> None:
    """The decode graphs' static inputs for `batch` sequences of `context` cached tokens each (their own blocks),
    each decoding its next token: a replay then does a real step's work."""
    rows, tables, size = runner.static["rows"], runner.static["tables"], runner.block_size
    blocks = -(-(context + 1) // size)
    ids = torch.arange(batch * blocks, dtype=torch.int32, device=rows.device).view(batch, blocks)
    tables[:batch, :blocks] = ids
    pos = context
    rows[:batch, 0], rows[:batch, 1], rows[:batch, 2] = 5, -1, pos
    rows[:batch, 3] = ids[:, pos // size] * size + pos % size
    rows[:batch, 4] = pos + 1
    rows[:batch, 5] = torch.arange(batch, dtype=torch.int32, device=rows.device)


# (name, fused projections, kernels.configs switches): the path as it is, with kernels/configs.py's one-attention-kernel
# switches (RoPE and the cache write, and the splits' merge, in the split kernel) together and each alone, without
# PDL, and the module path
ONE_ATTENTION_KERNEL = {"DECODE_ROPE_IN_ATTENTION": True, "DECODE_MERGE_IN_SPLIT": True}
PATHS = [("fused", True, {}),
         ("fused_one_attention_kernel", True, ONE_ATTENTION_KERNEL),
         ("fused_rope_in_attention", True, {"DECODE_ROPE_IN_ATTENTION": True}),
         ("fused_merge_in_split", True, {"DECODE_MERGE_IN_SPLIT": True}),
         ("fused_no_pdl", True, {"PDL": False}), ("modules", False, {"PDL": False})]


def decode_graphs(config: dict, paths: list[str]) -> dict:
    """Kernels and graph GPU time of decode steps on each of PATHS named in `paths`, in one process."""
    from kernels import configs

    tmp = Path(tempfile.mkdtemp())
    write_checkpoint(tmp, config)
    # Decode graphs only (no prefill or LoRA graphs, benchmarks/lora.py measures those): each path recaptures them.
    llm = LLM(str(tmp), dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=4096, max_loras=0,
              cuda_graph_max_prefill_tokens=0)
    runner, model = llm.engine.runner, llm.engine.model
    weights = {p.data_ptr(): p.nbytes for p in model.parameters()}  # tied embeddings once
    out = {"layers": model.config.num_hidden_layers, "weight_gb": sum(weights.values()) / 1e9,
           "floor_ms": 1e3 * sum(weights.values()) / COPY_BYTES_PER_S, "context": CONTEXT, "paths": {}}
    defaults = {key: getattr(configs, key) for _, _, switches in PATHS for key in switches}
    for name, fused, switches in [p for p in PATHS if p[0] in paths]:
        print(f"  {name}: capturing and timing ({time.strftime('%X')})", flush=True)
        for key, default in defaults.items():
            setattr(configs, key, switches.get(key, default) and (key != "PDL" or default))
        model.fuse_projections(fused)
        runner._pool = None
        runner._capture_decode_graphs()
        cells = {}
        for batch in GRAPH_BATCHES:
            prime_decode_rows(runner, batch, CONTEXT)
            with torch.inference_mode():
                forward = runner._decode_forward(batch)
                kernels, times = kernel_us(forward)
                layers = model.model.layers
                model.model.layers = layers[:1]
                one_layer, _ = kernel_us(forward)
                model.model.layers = layers
            cells[str(batch)] = {"graph_ms": replay_ms(runner.graphs[batch]), "kernels": kernels,
                                 "kernels_per_layer": (kernels - one_layer) / (len(layers) - 1)}
            if batch == 1:  # where a batch-1 step's GPU time goes (eager kernel times: launches not included)
                cells["1"]["kernel_us"] = dict(sorted(times.items(), key=lambda kv: -kv[1])[:14])
        out["paths"][name] = cells
    for key, default in defaults.items():
        setattr(configs, key, default)
    del llm, runner, model
    torch.cuda.empty_cache()
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def print_graphs(graphs: dict) -> None:
    print(f"{'shape':>14} {'batch':>6} {'path':>13} {'graph ms':>9} {'kernels':>8} {'/layer':>7} {'floor ms':>9}")
    for name, g in graphs.items():
        for batch in GRAPH_BATCHES:
            for path, cells in g["paths"].items():
                c = cells[str(batch)]
                print(f"{name:>14} {batch:>6} {path:>13} {c['graph_ms']:9.3f} {c['kernels']:8d} "
                      f"{c['kernels_per_layer']:7.1f} {g['floor_ms']:9.3f}")
        print(f"{name} batch 1, fused, GPU us per kernel name:", json.dumps(g["paths"]["fused"]["1"]["kernel_us"]))


def plot_graphs(graphs: dict, path: Path) -> None:
    """Graph GPU time per decode step by shape and batch, one bar per path, the floor as a line per shape."""
    labels = [f"{name} b{batch}" for name in graphs for batch in GRAPH_BATCHES]
    paths = [p for p, *_ in PATHS if all(p in g["paths"] for g in graphs.values())]
    series = {p: [graphs[name]["paths"][p][str(batch)]["graph_ms"] for name in graphs for batch in GRAPH_BATCHES]
              for p in paths}
    series["floor (weights once at 3 TB/s)"] = [graphs[name]["floor_ms"] for name in graphs for _ in GRAPH_BATCHES]
    grouped_bars(path, labels, series, "ms per decode step (CUDA graph)",
                 "Decode step: fused path vs module path (random weights, 512-token context)", figsize=(15, 5))


def _graph_ms(fn, calls: int = 24) -> float:
    """GPU time of one call of fn(i) in a CUDA graph of calls i = 0 .. calls - 1 (the launches as a decode step's
    graph pays them)."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return replay_ms(graph, 10) / calls


# (BLOCK_N, BLOCK_K, num_warps, num_stages, K splits); splits only where partial sums are taken (o and down, whose
# consumer is kernels.elementwise.add_rms_norm_)
LINEAR_CONFIGS = [(bn, bk, 4, st, 1) for bn in (16, 32, 64) for bk in (128, 256, 512) for st in (3, 4)] + [
    (64, 256, 8, 3, 1), (64, 512, 8, 3, 1), (32, 512, 8, 4, 1)]
SPLIT_CONFIGS = [(16, bk, 4, 3, s) for s in (2, 4, 8) for bk in (128, 256, 512)] + [
    (32, 256, 4, 3, s) for s in (2, 4)]
LINEAR_ROWS = (1, 16, 64)  # decode_linear is the model's up to 16 rows; 64 tells whether it could take more
DECODE_LORA_ROWS = ((1, (0, 1)), (16, (0, 1, 8)), (64, (0, 1, 8)))  # (rows, distinct adapters timed)
L2_BYTES = 50 * 2**20  # the H100's; every call below reads weights that are not in it, as a decode step does

# Per device: the prefill and decode sections' checkpoint, dtype and default prompt tokens, the repeats of the timed
# calls (wall_ms's and the attention call's host time), the TTFT's requests, the decode batches and their timed
# steps, (batch, rows on an adapter) of the step with one; the sweeps' shapes and rows, and their adapters (slots).
# The CPU's are tiny: the forward runs eagerly, and every sweep cell calls Triton's interpreter (seconds a sweep).
SETUPS = {"cuda": {"checkpoint": CONFIG, "dtype": "bfloat16", "tokens": 128, "repeat": 50, "attention_calls": 200,
                   "ttft_requests": 30, "decode_batches": (1, 64, 256), "decode_steps": 200, "adapter_batch": (64, 3),
                   "shapes": SHAPES, "lora_shape": SHAPES["Qwen2.5-0.5B"], "linear_rows": LINEAR_ROWS,
                   "lora_rows": (64, 256), "decode_lora_rows": DECODE_LORA_ROWS, "producer_rows": (64, 256),
                   "adapters": 8,
                   "weights": "random, in the models' shapes: times only"},
          "cpu": {"checkpoint": TINY_CONFIG, "dtype": "float32", "tokens": 16, "repeat": 3, "attention_calls": 5,
                  "ttft_requests": 4, "decode_batches": (1, 4), "decode_steps": 8, "adapter_batch": (4, 1),
                  "shapes": {"tiny": TINY_CONFIG}, "lora_shape": TINY_CONFIG, "linear_rows": LINEAR_ROWS,
                  "lora_rows": (16,), "decode_lora_rows": ((1, (0, 1)), (4, (0, 1, 2))), "producer_rows": (20, 72),
                  "adapters": 2,
                  "weights": "random, tiny Qwen2 (TINY_CONFIG) in float32, Triton in its interpreter: the CPU smoke, "
                             "whose numbers only show that the path runs"}}
# What the CPU cannot measure, and why: those fields say so rather than hold numbers.
CPU_SKIPS = {"graphs": "skipped on the CPU: CUDA graphs and their kernels' GPU times need CUDA",
             "step_gpu_ms": "skipped on the CPU: the profiler's GPU time needs CUDA",
             "decode_graph_ms": "skipped on the CPU: its decode steps run eagerly, there is no CUDA graph to replay"}


def hbm_copies(*shape: int, device: torch.device, cap: int = 256) -> list[torch.Tensor]:
    """Random bf16 tensors of `shape`, enough copies (up to `cap`) that calls going round them read three times
    L2's bytes: each call finds its tensor in HBM. On the CPU two float32 copies (the interpreter's dots want
    float32, and nothing there times memory)."""
    if device.type == "cpu":
        return [torch.randn(*shape) * 0.02 for _ in range(2)]
    copies = min(cap, max(2, -(-3 * L2_BYTES // (2 * torch.Size(shape).numel()))))
    return [torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def call_ms(fn, device: torch.device) -> float:
    """Milliseconds of one call of fn(i): on the GPU in a CUDA graph of calls (_graph_ms); on the CPU the wall clock
    of one eager call (Triton's interpreter: it shows that the call runs, not how fast)."""
    return _graph_ms(fn) if device.type == "cuda" else wall_ms(lambda: fn(0), reps=1, warmup=0)


def sweep_linear(setup: dict) -> list[dict]:
    """Each projection of both shapes (q/k/v and gate/up fused) at LINEAR_ROWS: cuBLAS (plus the separate SwiGLU
    kernel for gate/up) against kernels/decode_linear.py in each configuration; the best configuration per cell.
    Consecutive calls read different copies of the weight, more bytes than L2 holds: in a decode step every
    projection's weight comes from HBM (one projection timed on one weight would find it in L2)."""
    from kernels.decode_linear import decode_linear
    from kernels.elementwise import silu_mul

    device, dtype = setup["device"], getattr(torch, setup["dtype"])
    rows_out = []
    for name, c in setup["shapes"].items():
        h, inter = c["hidden_size"], c["intermediate_size"]
        d = c.get("head_dim") or h // c["num_attention_heads"]
        q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
        for proj, (n, k, silu) in {"qkv": (q + 2 * kv, h, False), "o": (h, q, False),
                                   "gate_up": (2 * inter, h, True), "down": (h, inter, False)}.items():
            ws = hbm_copies(n, k, device=device)
            copies = len(ws)
            for m in setup["linear_rows"]:
                x = torch.randn(m, k, device=device, dtype=dtype)
                if silu:
                    def cublas(i):
                        y = torch.nn.functional.linear(x, ws[i % copies])
                        silu_mul(y[:, :inter], y[:, inter:])
                else:
                    def cublas(i):
                        torch.nn.functional.linear(x, ws[i % copies])
                timed = {}
                for cfg in LINEAR_CONFIGS + (SPLIT_CONFIGS if proj in ("o", "down") else []):
                    try:
                        timed[cfg] = call_ms(lambda i, cfg=cfg: decode_linear(
                            x, ws[i % copies], silu_mul=silu, config=cfg, partials=cfg[-1] > 1), device)
                    except triton.runtime.errors.OutOfResources:  # shared memory: too many stages of this tile
                        continue
                best = min(timed, key=timed.get)
                row = {"shape": name, "proj": proj, "n": n, "k": k, "rows": m,
                       "cublas_us": 1e3 * call_ms(cublas, device), "best_us": 1e3 * timed[best], "best": best,
                       "floor_us": 1e6 * 2 * n * k / COPY_BYTES_PER_S,
                       "configs_us": {str(cfg): 1e3 * t for cfg, t in timed.items()}}
                rows_out.append(row)
                top = sorted(timed, key=timed.get)[:4]
                print(f"{name:>14} {proj:>8} rows {m:>2}: floor {row['floor_us']:5.1f} us, cuBLAS "
                      f"{row['cublas_us']:6.1f} us, decode_linear best " +
                      ", ".join(f"{1e3 * timed[t]:.1f} {t}" for t in top), flush=True)
    return rows_out


LORA_CONFIGS = [(chunk, bk, st) for chunk in (64, 128, 256) for bk in (128, 256, 512) for st in (2, 3, 4)]


def lora_cases(shape: dict, rank: int) -> dict:
    """Per projection group of a model shape: (K, widths of its projections, silu_mul, partials in a decode step)
    and its slot layout ([(N_p, A offset, B offset)] as decode_linear's `lora` takes it, a slot's size)."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    d = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    cases = {}
    for proj, (k, widths, silu, partials) in {"qkv": (h, [q, kv, kv], False, True), "o": (q, [h], False, True),
                                              "gate_up": (h, [inter, inter], True, False),
                                              "down": (inter, [h], False, True)}.items():
        parts, size = [], 0
        for n in widths:
            parts.append((n, size, size + rank * k))
            size += rank * (k + n)
        cases[proj] = (k, widths, silu, partials, parts, size)
    return cases


def sweep_decode_lora(setup: dict, rank: int = 16) -> list[dict]:
    """kernels/decode_linear.py with the rows' LoRA slots inside against without, each projection group of the
    Qwen2.5-0.5B shape: 1 row (no adapter, one), 16 and 64 rows (none, one, 8 distinct; 64 rows beside
    sweep_lora's cuBLAS + lora_add_ at 64); weights and slots read from HBM as in a step, the calls chained in a
    graph with PDL as a step's are."""
    import numpy as np

    from kernels.decode_linear import decode_linear
    from kernels.lora import lora_tiles, max_tiles

    device, dtype, slots = setup["device"], getattr(torch, setup["dtype"]), setup["adapters"]
    rows_out = []
    for proj, (k, widths, silu, partials, parts, size) in lora_cases(setup["lora_shape"], rank).items():
        ws, lws = hbm_copies(sum(widths), k, device=device), hbm_copies(slots, size, device=device)
        scales = torch.full((slots,), 2.0, device=device)
        for m, counts in setup["decode_lora_rows"]:
            x = torch.randn(m, k, device=device, dtype=dtype)
            row = {"proj": proj, "rows": m}
            for count in counts:
                tiles = torch.from_numpy(lora_tiles(np.arange(m, dtype=np.int32) % max(count, 1),
                                                    max_tiles(m, slots))).to(device)
                lora = (lambda i: (lws[i % len(lws)], scales, tiles, rank, parts)) if count else (lambda i: None)
                row[f"us_{count}"] = 1e3 * call_ms(lambda i: decode_linear(
                    x, ws[i % len(ws)], silu_mul=silu, lora=lora(i), partials=partials), device)
            rows_out.append(row)
            print(f"decode_linear {proj:>8} rows {m:>2}: " + ", ".join(
                f"{c} adapters {row[f'us_{c}']:.1f} us" for c in counts), flush=True)
    return rows_out


def sweep_lora(setup: dict, rank: int = 16) -> list[dict]:
    """kernels/lora.py beside cuBLAS (the steps of more than decode_linear's rows): each projection group of the
    Qwen2.5-0.5B shape at 64 and 256 rows spread over `adapters` slots of rank `rank`, in each configuration
    (N_CHUNK, BLOCK_K, num_stages), the slots' weights read from HBM as in a step."""
    import numpy as np

    from kernels.lora import lora_add_, lora_tiles, max_tiles

    device, dtype, adapters = setup["device"], getattr(torch, setup["dtype"]), setup["adapters"]
    rows_out = []
    for proj, (k, widths, _, _, parts, size) in lora_cases(setup["lora_shape"], rank).items():
        lws = hbm_copies(adapters, size, device=device)
        copies = len(lws)
        scales = torch.ones(adapters, device=device)
        for m in setup["lora_rows"]:
            x = torch.randn(m, k, device=device, dtype=dtype)
            y = torch.zeros(m, sum(widths), device=device, dtype=dtype)
            ys = y.split(widths, dim=1)
            slots = np.arange(m, dtype=np.int32) % adapters
            tiles = torch.from_numpy(lora_tiles(slots, max_tiles(m, adapters))).to(device)
            timed = {cfg: call_ms(lambda i, cfg=cfg: lora_add_(
                x, [(yp, a, b) for yp, (_, a, b) in zip(ys, parts)], lws[i % copies], scales, tiles, rank, config=cfg),
                device) for cfg in LORA_CONFIGS}
            best = min(timed, key=timed.get)
            row = {"proj": proj, "rows": m, "adapters": adapters, "best_us": 1e3 * timed[best], "best": best,
                   "configs_us": {str(cfg): 1e3 * t for cfg, t in timed.items()}}
            rows_out.append(row)
            print(f"lora_add_ {proj:>8} rows {m:>3}: " + ", ".join(
                f"{1e3 * timed[t]:.1f} {t}" for t in sorted(timed, key=timed.get)[:4]), flush=True)
    return rows_out


def sweep_lora_producers(setup: dict, rank: int = 16) -> list[dict]:
    """The launches that compute a LoRA step's shrinks in steps of more than decode_linear's rows (kernels/lora.py's
    columns layout), each beside the base step's launch it replaces or joins: the add + RMSNorm before q/k/v and
    before gate-up with their shrinks (past kernels.lora.ROW_SHRINK_MAX_ROWS with the tiles' launch after it)
    against add_rms_norm_; down's input silu(gate) * up with its shrinks against silu_mul; past the norms' rows o's
    input with its shrinks, where the base step launches nothing (up to them the attention's merge computes them).
    The Qwen2.5-0.5B shape, `adapters` slots on a 5% share of the rows (as in benchmarks/lora.py's served phase) and
    on all; each alone, 24 calls in a CUDA graph with PDL as a step's are, the slots read from HBM."""
    import numpy as np

    from kernels.elementwise import add_rms_norm_, add_rms_norm_shrinks, columns_input, silu_mul
    from kernels.lora import ROW_SHRINK_MAX_ROWS, lora_tiles, max_tiles, used_tiles

    device, dtype, slots = setup["device"], getattr(torch, setup["dtype"]), setup["adapters"]
    cases = lora_cases(setup["lora_shape"], rank)
    slot_copies = {group: hbm_copies(slots, case[-1], device=device) for group, case in cases.items()}
    scales = torch.full((slots,), 2.0, device=device)
    h, inter = setup["lora_shape"]["hidden_size"], setup["lora_shape"]["intermediate_size"]
    rows_out = []
    for m in setup["producer_rows"]:
        x, residual, att = (torch.randn(m, h, device=device, dtype=dtype) for _ in range(3))
        norm = torch.rand(h, device=device, dtype=dtype)
        gate, up = (torch.randn(m, inter, device=device, dtype=dtype) for _ in range(2))
        add_norm = lambda i: add_rms_norm_(x, residual, norm, 1e-6)  # noqa: E731
        base = {"qkv_norm": add_norm, "gate_up_norm": add_norm, "down_input": lambda i: silu_mul(gate, up),
                "o_input": None}
        for adapter_rows in (max(1, m // 20), m):
            row_slots = np.full(m, -1, dtype=np.int32)
            row_slots[:adapter_rows] = np.arange(adapter_rows) % slots
            tiles = torch.from_numpy(lora_tiles(row_slots, max_tiles(m, slots))).to(device)
            num_tiles = used_tiles(tiles, m, slots)

            def lora(group: str, i: int) -> tuple:  # the group's slots (a copy in HBM), scales, tiles, A offsets
                copies = slot_copies[group]
                return copies[i % len(copies)], scales, tiles, rank, [a for _, a, _ in cases[group][4]]

            calls = {f"{group}_norm": lambda i, group=group: add_rms_norm_shrinks(
                x, residual, norm, 1e-6, lora(group, i), columns=True) for group in ("qkv", "gate_up")}
            calls["down_input"] = lambda i: columns_input(gate, *lora("down", i), num_tiles, up=up)
            if m > ROW_SHRINK_MAX_ROWS:
                calls["o_input"] = lambda i: columns_input(att, *lora("o", i), num_tiles)
            for producer, call in calls.items():
                row = {"rows": m, "adapter_rows": adapter_rows, "producer": producer,
                       "base_us": base[producer] and 1e3 * call_ms(base[producer], device),
                       "lora_us": 1e3 * call_ms(call, device)}
                rows_out.append(row)
                print(f"LoRA producer {producer:>12} rows {m:>3}, {adapter_rows:>3} on adapters: {row['lora_us']:.2f} "
                      f"us against {row['base_us'] or 0:.2f}", flush=True)
    return rows_out


def engine_ttft(llm, tokens: int, requests: int) -> dict:
    """The engine's share of the time to first token: add_request of a fresh prompt (no prefix hit) on an idle
    engine, stepped until its first token, median over requests; and where that host time goes (cProfile)."""
    engine, params = llm.engine, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    times, profile = [], cProfile.Profile()
    for i in range(requests):
        prompt = torch.randint(3, engine.model.config.vocab_size, (tokens,), generator=g).tolist()
        synchronize(engine.device)
        if i >= requests // 2:
            profile.enable()
        start = time.perf_counter()
        engine.add_request(f"ttft-{i}", prompt, params)
        while not any(out.request_id == f"ttft-{i}" for out in engine.step()[0]):
            pass
        times.append(time.perf_counter() - start)
        profile.disable()
        while engine.has_work:
            engine.step()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    print(f"engine TTFT ({tokens}-token prompt): {1e3 * sorted(times)[len(times) // 2]:.2f} ms\n{text.getvalue()}")
    return {"engine_ttft_ms": 1e3 * sorted(times)[len(times) // 2], "prefill_graphs": len(engine.runner.prefill_graphs),
            "engine_ttft_profile": text.getvalue()[-3500:]}


def _decode_steps(engine, batch: int, steps: int, adapter_rows: int = 0, tag: str = "decode") -> float:
    """Starts `batch` requests (the first adapter_rows on the adapter "profile"), runs them into steady decoding,
    and returns the mean wall time of the next `steps` overlapped steps."""
    params = SamplingParams(max_new_tokens=4 * steps, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{batch}-{adapter_rows}-{i}", list(range(3, 131)), params,
                           adapter="profile" if i < adapter_rows else None)
    for _ in range(10):  # the prefill and the first decodes
        engine.step()
    synchronize(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1e3 * (time.perf_counter() - start) / steps


def _finish(engine) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_work:
        engine.step()


def lora_decode_step_ms(llm, batch: int, adapter_rows: int, steps: int) -> float:
    """Mean decode step at this batch when adapter_rows of its sequences ask for a (random, rank 8) LoRA adapter,
    against decode_profile's steps without: a step with an adapter replays the LoRA graphs (the adapter in a slot)."""
    from service.model.lora import Adapter, LoRAConfig, add_adapter

    engine = llm.engine
    adapter = Adapter.init(engine.model, LoRAConfig(rank=8), seed=0)
    add_adapter(engine.model, "profile", adapter.to(engine.device, engine.model.lm_head.weight.dtype))
    step_ms = _decode_steps(engine, batch, steps, adapter_rows)
    _finish(engine)
    print(f"decode batch {batch} with {adapter_rows} adapter rows: {step_ms:.3f} ms per step")
    return step_ms


def decode_profile(llm, batch: int, steps: int) -> dict:
    """Mean wall time of decode steps at this batch (overlapped, CUDA graphs), then the same steps under cProfile.
    On CUDA also the steps of new requests without the engine's PDL primer (kernels/pdl_primer.py), and the GPU
    time of the step's graph replayed right after them, without the primer and with it: the slow state the primer
    ends, measured. (The replays rewrite the last step's cache slots; the requests end here.) On the CPU, whose
    steps run eagerly, neither."""
    engine = llm.engine
    step_ms = _decode_steps(engine, batch, steps)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    _finish(engine)
    if engine.device.type != "cuda":
        return {"step_ms": step_ms, "profile": text.getvalue()[-3500:]}
    runner = engine.runner
    key = next(bs for bs in runner.graphs if bs >= batch)
    shipped, runner.pdl_primer = runner.pdl_primer, False
    try:
        unprimed_ms = _decode_steps(engine, batch, steps, tag="unprimed")
        graph_ms = {"without_primer": replay_ms(runner.graphs[key], prime=False),
                    "primed": replay_ms(runner.graphs[key])}
    finally:
        runner.pdl_primer = shipped
        _finish(engine)
    return {"step_ms": step_ms, "step_ms_without_primer": unprimed_ms, "graph_ms": graph_ms,
            "profile": text.getvalue()[-3500:]}


if __name__ == "__main__":
    main()
