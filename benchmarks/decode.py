"""Decode attention bandwidth: our paged split-KV kernel vs SDPA (flash, cuDNN) and FlexAttention on a
contiguous cache. Effective bandwidth = K+V bytes of the used context / time.

Each provider is timed the way a server runs decode: captured in a CUDA graph (so host overhead is out of the
picture for every provider alike), replayed with a cold L2 (flushed before each replay; a 4096-token cache would
otherwise sit in the 50 MB L2), median of 100 replays timed with CUDA events.

python benchmarks/decode.py [--out DIR]
"""
import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bar_chart import grouped_bars  # noqa: E402
from kernels.decode import flash_attn_with_kvcache  # noqa: E402

NHEADS, NHEADS_K, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
SHAPES = [(1, 4096), (1, 16384), (1, 65536), (16, 4096), (64, 4096), (64, 16384), (256, 2048)]
BLOCK_SIZES = [16, 128]


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


def ours(block_size):
    def setup(batch, ctx):
        blocks_per_seq = -(-ctx // block_size)
        k_cache = torch.randn(batch * blocks_per_seq, block_size, NHEADS_K, HEAD_DIM, dtype=DTYPE, device="cuda")
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(batch * blocks_per_seq, device="cuda").int().view(batch, blocks_per_seq)
        q = torch.randn(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        return lambda: flash_attn_with_kvcache(q, k_cache, v_cache, lens, table)
    return setup


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def setup(batch, ctx):
        q = torch.randn(batch, NHEADS, 1, HEAD_DIM, dtype=DTYPE, device="cuda")
        k = torch.randn(batch, NHEADS_K, ctx, HEAD_DIM, dtype=DTYPE, device="cuda")
        v = torch.randn_like(k)

        def run():
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            run()
            return run
        except RuntimeError:  # backend without GQA: expand K/V heads (the timing still counts unique bytes)
            k, v = (x.repeat_interleave(NHEADS // NHEADS_K, dim=1) for x in (k, v))

            def run_expanded():
                with sdpa_kernel(backend):
                    return scaled_dot_product_attention(q, k, v)
            return run_expanded
    return setup


def flex():
    from torch.nn.attention.flex_attention import flex_attention
    compiled = torch.compile(flex_attention, dynamic=False)

    def setup(batch, ctx):
        q = torch.randn(batch, NHEADS, 1, HEAD_DIM, dtype=DTYPE, device="cuda")
        k = torch.randn(batch, NHEADS_K, ctx, HEAD_DIM, dtype=DTYPE, device="cuda")
        v = torch.randn_like(k)
        return lambda: compiled(q, k, v, enable_gqa=True)
    return setup


def providers():
    from torch.nn.attention import SDPBackend
    found = {f"ours bs{bs}": ours(bs) for bs in BLOCK_SIZES}
    found["sdpa flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    found["sdpa cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    found["flex"] = flex()
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "nheads": NHEADS, "nheads_k": NHEADS_K, "head_dim": HEAD_DIM, "dtype": str(DTYPE),
               "unit": "TB/s", "timing": "CUDA graph replay, cold L2, median of 100", "rows": []}
    provs = providers()
    names = list(provs)
    print(f"{'batch x ctx':>14} " + " ".join(f"{n:>12}" for n in names))
    for batch, ctx in SHAPES:
        kv_bytes = 2 * batch * ctx * NHEADS_K * HEAD_DIM * DTYPE.itemsize
        row = {"batch": batch, "ctx": ctx, "tbps": {}, "errors": {}}
        for name, setup in provs.items():
            fn = None
            try:
                fn = setup(batch, ctx)
                ms = time_graph(fn)
                row["tbps"][name] = kv_bytes / (ms * 1e-3) / 1e12
            except Exception as e:  # record and go on: one failing peer must not stop the table
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:200]}"
            del fn
            torch.cuda.empty_cache()
        results["rows"].append(row)
        cells = [f"{row['tbps'][n]:12.2f}" if n in row["tbps"] else f"{'error':>12}" for n in names]
        print(f"{f'{batch}x{ctx}':>14} " + " ".join(cells), flush=True)
    for row in results["rows"]:
        for name, err in row["errors"].items():
            print(f"{row['batch']}x{row['ctx']} {name}: {err}")
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(results, names, os.path.join(args.out, "decode.png"))


def plot(results, names, path):
    labels = [f"{r['batch']}x{r['ctx']}" for r in results["rows"]]
    series = {name: [r["tbps"].get(name, 0.0) for r in results["rows"]] for name in names}
    grouped_bars(path, labels, series, "effective bandwidth (TB/s)",
                 f"decode attention, {NHEADS}/{NHEADS_K} heads, d={HEAD_DIM}, bf16 ({results['gpu']})")


if __name__ == "__main__":
    main()
