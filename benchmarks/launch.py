"""Host time of one attention call: what Python spends before the GPU has the work, per API layer, beside the
GPU time of the same call and beside SDPA's own host time.

Small and medium shapes (bf16, 16 heads of 128, causal), where the host time is a large part of the call: the
public flash-attn-style API (`flash_attn_func`, fixed length; `flash_attn_varlen_func`) under inference and with
inputs that need gradients (the autograd node), and the launcher the engine calls (`flash_attn_forward`, no
validation or autograd). Host time: the median of 300 calls, each timed from its start to its return, the GPU kept
busy behind them (no call waits for the GPU). GPU time: triton's do_bench of the launcher.

python benchmarks/launch.py [--out DIR]
python benchmarks/launch.py --device cpu  # the smoke CI runs: one tiny fp32 shape in Triton's interpreter, no gpu_us
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bar_chart import grouped_bars  # noqa: E402
from benchmarks.provenance import git_commit  # noqa: E402
from benchmarks.timing import wall_ms  # noqa: E402
from kernels.interface import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from kernels.prefill import flash_attn_forward  # noqa: E402

# Per device: (batch, seqlen) shapes, heads, head_dim, dtype, and calls timed (after `warmup`) per measurement. On
# the CPU the kernels run in Triton's interpreter (about 0.1 s a call at 64 tokens; bf16 dots are garbage there).
SETUPS = {"cuda": {"shapes": [(1, 128), (4, 512), (16, 1024)], "heads": 16, "head_dim": 128,
                   "dtype": torch.bfloat16, "calls": 300, "warmup": 20},
          "cpu": {"shapes": [(1, 64)], "heads": 2, "head_dim": 16, "dtype": torch.float32, "calls": 3, "warmup": 1}}


def host_us(fn, device: str, calls: int, warmup: int) -> float:
    # Each call from an idle GPU, so the time is the call's host work alone: with 50 calls between synchronizations
    # the Gluon forward at 16 x 1024 (GPU time 157 us, host time about 70) read 148 us, its calls waiting on the GPU.
    # On the CPU there is no queue to drain: the call's time is all host time (the interpreter's included).
    return 1e3 * wall_ms(fn, reps=calls, warmup=warmup, device=device, until_done=False)


def measure(batch: int, seqlen: int, device: str, setup: dict) -> dict:
    heads, head_dim = setup["heads"], setup["head_dim"]
    shape = (batch, seqlen, heads, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=setup["dtype"]) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    flat = [t.view(batch * seqlen, heads, head_dim) for t in (q, k, v)]
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    calls = {
        "flash_attn_func": lambda: flash_attn_func(q, k, v, causal=True),
        "flash_attn_func, grad": lambda: flash_attn_func(qg, kg, vg, causal=True),
        "flash_attn_varlen_func": lambda: flash_attn_varlen_func(*flat, cu, cu, seqlen, seqlen, causal=True),
        "launcher": lambda: flash_attn_forward(*flat, cu, cu, seqlen, seqlen, scale, True),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
    }
    row = {"batch": batch, "seqlen": seqlen}
    timed = lambda fn: host_us(fn, device, setup["calls"], setup["warmup"])  # noqa: E731
    with torch.inference_mode():
        row |= {name: timed(fn) for name, fn in calls.items() if "grad" not in name}
    row["flash_attn_func, grad"] = timed(calls["flash_attn_func, grad"])
    with torch.inference_mode():
        row["gpu_us"] = 1e3 * do_bench(calls["launcher"], warmup=25, rep=100) if device == "cuda" else \
            "skipped on the CPU: do_bench times GPU kernels"
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = SETUPS[args.device]
    rows = [measure(b, n, args.device, setup) for b, n in setup["shapes"]]
    names = [k for k in rows[0] if k not in ("batch", "seqlen")]
    fmt = lambda x: f"{x:22.1f}" if isinstance(x, float) else f"{x:>22}"  # noqa: E731
    print(f"host us per call (median of {setup['calls']}); gpu_us: the launcher's GPU time")
    print(f"{'batch x seqlen':>15} " + " ".join(f"{n:>22}" for n in names))
    for r in rows:
        print(f"{r['batch']:>6} x {r['seqlen']:<6} " + " ".join(fmt(r[n]) for n in names))
    result = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "commit": git_commit(), "heads": setup["heads"],
              "head_dim": setup["head_dim"], "rows": rows}
    (out / "launch.json").write_text(json.dumps(result, indent=2))
    labels = [f"{r['batch']}x{r['seqlen']}" for r in rows]
    plotted = [n for n in names if all(isinstance(r[n], float) for r in rows)]  # a skipped one has no bar
    grouped_bars(out / "launch.png", labels, {n: [r[n] for r in rows] for n in plotted}, "microseconds",
                 f"Host time of one attention call, beside its GPU time ({result['gpu']})", figsize=(10, 4))


if __name__ == "__main__":
    main()
