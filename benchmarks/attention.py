"""Attention forward/backward throughput: ours vs SDPA (flash, cuDNN) vs FlexAttention on one GPU.

python benchmarks/attention.py [--out DIR] [--mode fwd|bwd|both] [--quick]
python benchmarks/attention.py --device cpu  # the smoke CI runs: ours in Triton's interpreter vs SDPA math, 64 tokens
"""
import argparse
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.provenance import git_commit  # noqa: E402
from benchmarks.timing import wall_ms  # noqa: E402
from kernels.interface import flash_attn_func, flash_attn_varlen_func  # noqa: E402

# Per device: batches of `tokens` tokens (batch = tokens // seqlen) and hidden // head_dim heads for each head_dim and
# seqlen; `rounds` timings per provider, pass and shape, the fastest counting; the varlen row's sequences. The CPU
# smoke runs our kernels in Triton's interpreter (~0.1 s a forward at 64 tokens; bf16 dots are garbage there).
SETUPS = {"cuda": {"tokens": 16384, "hidden": 2048, "head_dims": (64, 128), "dtype": torch.bfloat16, "rounds": 2,
                   "seqlens": [512, 1024, 2048, 4096, 8192, 16384], "quick_seqlens": [1024, 4096],
                   "varlen": {"num_seqs": 64, "min_len": 64, "max_len": 2048, "fixed_seqlen": 1024, "nheads": 16,
                              "head_dim": 128}},
          "cpu": {"tokens": 64, "hidden": 64, "head_dims": (32,), "dtype": torch.float32, "rounds": 1,
                  "seqlens": [64], "quick_seqlens": [64],
                  "varlen": {"num_seqs": 3, "min_len": 16, "max_len": 64, "fixed_seqlen": 32, "nheads": 2,
                             "head_dim": 32}}}
FLEX_TIME_BUDGET_S = 240  # Flex compiles per shape; past this it is skipped (cold machine: ~150 s to hd128 causal)
# The GPU's peers that the CPU cannot run, and why: their rows say so rather than hold numbers.
CPU_SKIPS = {"sdpa_flash": "skipped on the CPU: SDPA's flash backend needs CUDA",
             "sdpa_cudnn": "skipped on the CPU: cuDNN needs CUDA",
             "flex": "skipped on the CPU: torch.compile of FlexAttention takes ~20 s a shape there"}


def _has_backward():
    try:
        from kernels.backward import flash_attn_backward  # noqa: F401
        return True
    except ImportError:
        return False


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v, causal):  # [B, H, N, D]
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.cache_size_limit = 256
    torch._functorch.config.donated_buffer = False  # the benchmark replays backward on one graph (retain_graph)
    compiled = torch.compile(flex_attention)
    masks = {}

    def run(q, k, v, causal):
        block_mask = None
        if causal:
            n = q.shape[2]
            if n not in masks:
                masks[n] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device="cuda")
            block_mask = masks[n]
        return compiled(q, k, v, block_mask=block_mask)
    return run


def _providers(device):
    """name -> (fn, layout) of the providers that run on `device`, and name -> why of the GPU's that cannot run there
    (on the CPU, SDPA's math backend is our peer)."""
    from torch.nn.attention import SDPBackend

    ours = lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)  # noqa: E731
    if device == "cpu":
        return {"ours": (ours, "bnhd"), "sdpa_math": (_sdpa(SDPBackend.MATH), "bhnd")}, CPU_SKIPS
    return {"ours": (ours, "bnhd"), "sdpa_flash": (_sdpa(SDPBackend.FLASH_ATTENTION), "bhnd"),
            "sdpa_cudnn": (_sdpa(SDPBackend.CUDNN_ATTENTION), "bhnd"), "flex": (_flex(), "bhnd")}, {}


def _inputs(batch, seqlen, nheads, head_dim, layout, grad, device, dtype):
    shape = (batch, seqlen, nheads, head_dim) if layout == "bnhd" else (batch, nheads, seqlen, head_dim)
    return [torch.randn(shape, device=device, dtype=dtype, requires_grad=grad) for _ in range(3)]


def _ms(fn, device, grad_to_none=None):
    """Median milliseconds of a call of fn: triton's do_bench on the GPU, the wall clock on the CPU."""
    if device == "cuda":
        return do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
    return wall_ms(fn)


def _bench(fn, layout, batch, seqlen, nheads, head_dim, causal, mode, device, dtype):
    """Returns {"fwd": ms, "bwd": ms} for the requested passes, one timing each (main keeps each provider's fastest
    of its rounds)."""
    res = {}
    q, k, v = _inputs(batch, seqlen, nheads, head_dim, layout, mode != "fwd", device, dtype)
    if mode in ("fwd", "both"):
        with torch.no_grad():
            res["fwd"] = _ms(lambda: fn(q, k, v, causal), device)
    if mode in ("bwd", "both"):
        out = fn(q, k, v, causal)
        dout = torch.randn_like(out)
        res["bwd"] = _ms(lambda: out.backward(dout, retain_graph=True), device, grad_to_none=[q, k, v])
    return res


def _tflops(ms, batch, seqlen, nheads, head_dim, causal, pass_):
    flops = 4 * batch * nheads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    flops *= 2.5 if pass_ == "bwd" else 1.0
    return flops / (ms * 1e-3) / 1e12


def _peak_memory(fn, layout, seqlen, nheads, head_dim):
    batch = SETUPS["cuda"]["tokens"] // seqlen
    q, k, v = _inputs(batch, seqlen, nheads, head_dim, layout, True, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(q, k, v, True).backward(torch.randn_like(q))
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _varlen_row(device, dtype, num_seqs, min_len, max_len, fixed_seqlen, nheads, head_dim, causal=True):
    """num_seqs random-length sequences (the same draw every run) vs a fixed-length batch with the same number of
    tokens (forward)."""
    lens = torch.randint(min_len, max_len + 1, (num_seqs,), generator=torch.Generator().manual_seed(0)).tolist()
    total = sum(lens)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(lens, device=device).cumsum(0)
    q, k, v = (torch.randn(total, nheads, head_dim, device=device, dtype=dtype) for _ in range(3))
    ms_var = _ms(lambda: flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal), device)
    flops_var = sum(4 * nheads * n * n * head_dim * (0.5 if causal else 1.0) for n in lens)
    batch = max(1, total // fixed_seqlen)
    qf, kf, vf = (torch.randn(batch, fixed_seqlen, nheads, head_dim, device=device, dtype=dtype) for _ in range(3))
    ms_fix = _ms(lambda: flash_attn_func(qf, kf, vf, causal=causal), device)
    tf_var = flops_var / (ms_var * 1e-3) / 1e12
    tf_fix = _tflops(ms_fix, batch, fixed_seqlen, nheads, head_dim, causal, "fwd")
    return {"num_seqs": num_seqs, "total_tokens": total, "varlen_tflops": tf_var, "fixed_seqlen": fixed_seqlen,
            "fixed_batch": batch, "fixed_tflops": tf_fix, "ratio": tf_var / tf_fix}


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4), squeeze=False)
    for ax, (hd, causal) in zip(axes[0], combos):
        for provider in sorted({r["provider"] for r in rows}):
            for pass_, style in (("fwd", "-o"), ("bwd", "--x")):
                pts = [(r["seqlen"], r[f"{pass_}_tflops"]) for r in rows if r["provider"] == provider and
                       r["head_dim"] == hd and r["causal"] == causal and isinstance(r.get(f"{pass_}_tflops"), float)]
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{provider} {pass_}")
        ax.set(xscale="log", xlabel="seqlen", ylabel="TFLOP/s", title=f"hd{hd} {'causal' if causal else 'full'}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--mode", choices=["fwd", "bwd", "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="seqlen 1024 and 4096 only")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    setup, cuda = SETUPS[args.device], args.device == "cuda"
    seqlens = setup["quick_seqlens"] if args.quick else setup["seqlens"]
    has_bwd = _has_backward()
    providers, skipped = _providers(args.device)
    start = time.time()
    rows = []
    fmt = lambda x: format(x, "9.1f" if cuda else "9.2g") if isinstance(x, float) else f"{str(x):>9}"  # noqa: E731
    print(f"{'provider':>11} {'hd':>4} {'causal':>6} {'N':>6} {'B':>3} {'fwd TF/s':>9} {'bwd TF/s':>9}  error")
    for head_dim in setup["head_dims"]:
        nheads = setup["hidden"] // head_dim
        for causal in (False, True):
            for seqlen in seqlens:
                batch = setup["tokens"] // seqlen
                shape_rows, modes = {}, {}
                for name in [*providers, *skipped]:
                    shape_rows[name] = {"provider": name, "head_dim": head_dim, "nheads": nheads, "causal": causal,
                                        "seqlen": seqlen, "batch": batch, "fwd_tflops": None, "bwd_tflops": None,
                                        "error": skipped.get(name)}
                    modes[name] = None if name in skipped else args.mode
                    if name == "ours" and not has_bwd and args.mode != "fwd":
                        shape_rows[name]["bwd_tflops"] = "n/a"
                        modes[name] = "fwd" if args.mode == "both" else None
                # The providers take turns, two rounds on the GPU, and each pass keeps its faster timing: one timing
                # alone read up to 35% slow at times (a different shape each run), and the GPU's clocks drift over
                # a shape's minute, so back-to-back timings of one provider favoured whichever ran in the better one.
                for round_ in range(setup["rounds"]):
                    for name, (fn, layout) in providers.items():
                        row, mode = shape_rows[name], modes[name]
                        if not mode or row["error"]:
                            continue
                        try:
                            if name == "flex" and round_ == 0 and time.time() - start > FLEX_TIME_BUDGET_S:
                                raise RuntimeError("skipped: time budget spent")
                            for pass_, ms in _bench(fn, layout, batch, seqlen, nheads, head_dim, causal, mode,
                                                    args.device, setup["dtype"]).items():
                                tflops = _tflops(ms, batch, seqlen, nheads, head_dim, causal, pass_)
                                row[f"{pass_}_tflops"] = max(row[f"{pass_}_tflops"] or 0.0, tflops)
                        except Exception as exc:  # one failing peer must not kill the run
                            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                            row["fwd_tflops"] = row["bwd_tflops"] = None
                        torch.cuda.empty_cache()
                for name, row in shape_rows.items():
                    rows.append(row)
                    print(f"{name:>11} {head_dim:>4} {str(causal):>6} {seqlen:>6} {batch:>3} "
                          f"{fmt(row['fwd_tflops'])} {fmt(row['bwd_tflops'])}  {row['error'] or ''}", flush=True)

    memory = {}
    for name in ("ours", "sdpa_flash"):
        if not cuda:  # read from the CUDA allocator's statistics
            memory[name] = "skipped on the CPU: torch.cuda memory stats"
            continue
        fn, layout = providers[name]
        try:
            if name == "ours" and not has_bwd:
                raise RuntimeError("n/a: kernels.backward missing")
            memory[name] = _peak_memory(fn, layout, 4096, 16, 128)
        except Exception as exc:
            memory[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    print(f"peak fwd+bwd memory MiB (hd128 causal N=4096 B=4): {memory}")
    spec = setup["varlen"]
    try:
        varlen = _varlen_row(args.device, setup["dtype"], **spec)
    except Exception as exc:
        varlen = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    print(f"varlen ({spec['num_seqs']} seqs, {spec['min_len']}..{spec['max_len']}) vs fixed: {varlen}")

    result = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "dtype": str(setup["dtype"]).removeprefix("torch."),
              "tokens_per_batch": setup["tokens"], "hidden": setup["hidden"], "mode": args.mode,
              "backward_available": has_bwd, "commit": git_commit(), "rows": rows,
              "peak_memory_mib": memory, "varlen": varlen, "elapsed_s": time.time() - start}
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump(result, f, indent=2)
    try:
        _plot(rows, os.path.join(args.out, "attention.png"))
    except Exception as exc:
        print(f"plot failed: {exc}")
    print(f"wrote {args.out}/attention.json and attention.png in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
