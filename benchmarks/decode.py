"""Decode attention bandwidth: our paged split-KV kernel vs SDPA (flash, cuDNN) and FlexAttention on a
contiguous cache. Effective bandwidth = K+V bytes of the used context / time.

Each provider is timed the way a server runs decode: captured in a CUDA graph (so host overhead is out of the
picture for every provider alike), replayed with a cold L2 (flushed before each replay; a 4096-token cache would
otherwise sit in the 50 MB L2), median of 100 replays timed with CUDA events.

python benchmarks/decode.py [--out DIR]
python benchmarks/decode.py --device cpu  # the smoke CI runs: 2 tiny fp32 shapes, ours in Triton's interpreter
"""
import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bar_chart import grouped_bars  # noqa: E402
from benchmarks.provenance import git_commit  # noqa: E402
from benchmarks.timing import wall_ms  # noqa: E402
from kernels.decode import flash_attn_with_kvcache  # noqa: E402

BLOCK_SIZES = [16, 128]
# Per device: heads (of q, of K/V), head_dim, dtype and (batch, context) shapes. On the CPU our kernel runs in
# Triton's interpreter (where bf16 dots are garbage), so the smoke's shapes are tiny (64 tokens: half a block of 128).
SETUPS = {"cuda": {"nheads": 32, "nheads_k": 8, "head_dim": 128, "dtype": torch.bfloat16, "dtype_name": "bf16",
                   "shapes": [(1, 4096), (1, 16384), (1, 65536), (16, 4096), (64, 4096), (64, 16384), (256, 2048)],
                   "timing": "CUDA graph replay, cold L2, median of 100"},
          "cpu": {"nheads": 2, "nheads_k": 1, "head_dim": 32, "dtype": torch.float32, "dtype_name": "fp32",
                  "shapes": [(1, 64), (1, 128)], "timing": "wall clock of eager calls, median of 3 (CPU smoke)"}}
# The GPU's peers that the CPU cannot run, and why: their cells say so rather than hold numbers.
CPU_SKIPS = {"sdpa flash": "skipped on the CPU: SDPA's flash backend needs CUDA",
             "sdpa cudnn": "skipped on the CPU: cuDNN needs CUDA",
             "flex": "skipped on the CPU: torch.compile of FlexAttention takes ~20 s a shape there"}


def time_graph(fn, reps=100):
    """Median ms of one replay of fn captured in a CUDA graph, L2 flushed before each replay."""
    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[reps // 2]


def ours(block_size, cfg):
    def setup(batch, ctx):
        blocks_per_seq = -(-ctx // block_size)
        k_cache = torch.randn(batch * blocks_per_seq, block_size, cfg["nheads_k"], cfg["head_dim"], dtype=cfg["dtype"],
                              device=cfg["device"])
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(batch * blocks_per_seq, device=cfg["device"]).int().view(batch, blocks_per_seq)
        q = torch.randn(batch, 1, cfg["nheads"], cfg["head_dim"], dtype=cfg["dtype"], device=cfg["device"])
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=cfg["device"])
        return lambda: flash_attn_with_kvcache(q, k_cache, v_cache, lens, table)
    return setup


def contiguous_qkv(batch, ctx, cfg):
    """q [batch, nheads, 1, head_dim] and a contiguous K/V cache [batch, nheads_k, ctx, head_dim]."""
    q = torch.randn(batch, cfg["nheads"], 1, cfg["head_dim"], dtype=cfg["dtype"], device=cfg["device"])
    k = torch.randn(batch, cfg["nheads_k"], ctx, cfg["head_dim"], dtype=cfg["dtype"], device=cfg["device"])
    return q, k, torch.randn_like(k)


def sdpa(backend, cfg):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def setup(batch, ctx):
        q, k, v = contiguous_qkv(batch, ctx, cfg)

        def run():
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            run()
            return run
        except RuntimeError:  # backend without GQA: expand K/V heads (the timing still counts unique bytes)
            k, v = (x.repeat_interleave(cfg["nheads"] // cfg["nheads_k"], dim=1) for x in (k, v))

            def run_expanded():
                with sdpa_kernel(backend):
                    return scaled_dot_product_attention(q, k, v)
            return run_expanded
    return setup


def flex(cfg):
    from torch.nn.attention.flex_attention import flex_attention
    compiled = torch.compile(flex_attention, dynamic=False)

    def setup(batch, ctx):
        q, k, v = contiguous_qkv(batch, ctx, cfg)
        return lambda: compiled(q, k, v, enable_gqa=True)
    return setup


def providers(cfg):
    """name -> setup(batch, ctx) -> the call to time, for the providers that run on cfg["device"]; the CPU's peer is
    SDPA's math backend, where the GPU's (CPU_SKIPS) cannot run."""
    from torch.nn.attention import SDPBackend
    found = {f"ours bs{bs}": ours(bs, cfg) for bs in BLOCK_SIZES}
    if cfg["device"] == "cpu":
        found["sdpa math"] = sdpa(SDPBackend.MATH, cfg)
        return found
    found["sdpa flash"] = sdpa(SDPBackend.FLASH_ATTENTION, cfg)
    found["sdpa cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION, cfg)
    found["flex"] = flex(cfg)
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg = SETUPS[args.device] | {"device": args.device}
    cuda = args.device == "cuda"
    results = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "triton": triton.__version__, "commit": git_commit(), "nheads": cfg["nheads"],
               "nheads_k": cfg["nheads_k"], "head_dim": cfg["head_dim"], "dtype": str(cfg["dtype"]), "unit": "TB/s",
               "timing": cfg["timing"], "rows": []}
    provs = providers(cfg)
    skips = {} if cuda else CPU_SKIPS
    names = [*provs, *skips]
    number = "12.2f" if cuda else "12.2g"  # the interpreter's bandwidth is a few hundred kB/s
    print(f"{'batch x ctx':>14} " + " ".join(f"{n:>12}" for n in names))
    for batch, ctx in cfg["shapes"]:
        kv_bytes = 2 * batch * ctx * cfg["nheads_k"] * cfg["head_dim"] * cfg["dtype"].itemsize
        row = {"batch": batch, "ctx": ctx, "tbps": {}, "errors": dict(skips)}
        for name, setup in provs.items():
            fn = None
            try:
                fn = setup(batch, ctx)
                ms = time_graph(fn) if cuda else wall_ms(fn)
                row["tbps"][name] = kv_bytes / (ms * 1e-3) / 1e12
            except Exception as e:  # record and go on: one failing peer must not stop the table
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:200]}"
            del fn
            torch.cuda.empty_cache()
        results["rows"].append(row)
        cells = [format(row["tbps"][n], number) if n in row["tbps"] else f"{'skipped' if n in skips else 'error':>12}"
                 for n in names]
        print(f"{f'{batch}x{ctx}':>14} " + " ".join(cells), flush=True)
    for row in results["rows"]:
        for name, err in row["errors"].items():
            print(f"{row['batch']}x{row['ctx']} {name}: {err}")
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(results, list(provs), cfg, os.path.join(args.out, "decode.png"))


def plot(results, names, cfg, path):
    labels = [f"{r['batch']}x{r['ctx']}" for r in results["rows"]]
    series = {name: [r["tbps"].get(name, 0.0) for r in results["rows"]] for name in names}
    grouped_bars(path, labels, series, "effective bandwidth (TB/s)",
                 f"decode attention, {cfg['nheads']}/{cfg['nheads_k']} heads, d={cfg['head_dim']}, "
                 f"{cfg['dtype_name']} ({results['gpu']})")


if __name__ == "__main__":
    main()
