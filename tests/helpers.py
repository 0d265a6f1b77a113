"""Shared test helpers: the kernel tests' error measure and inputs, and the benchmarks' smokes as subprocesses with
what they leave where a GPU number would be."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

ROOT = Path(__file__).resolve().parents[1]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf so it can never pass."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def random_slots(parts_n, k, slots, rank, device, dtype, gen):
    """LoRA slot weights [slots, size] holding, per projection of width n, A [rank, k] then B [n, rank]; random
    scales [slots]; each projection's (n, A offset, B offset)."""
    parts, size = [], 0
    for n in parts_n:
        parts.append((n, size, size + rank * k))
        size += rank * (k + n)
    weights = (torch.randn(slots, size, generator=gen) * 0.3).to(device, dtype)
    scales = (torch.rand(slots, generator=gen) + 0.5).to(device)
    return weights, scales, parts


def random_seqlens(batch: int, max_len: int, min_len: int = 1) -> list[int]:
    return torch.randint(min_len, max_len + 1, (batch,)).tolist()


def cu_seqlens(lengths: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu.to(device)


def is_skip_reason(text) -> bool:
    """Whether a benchmark's CPU smoke left `text` where a GPU number would be: "skipped on the CPU: " and why."""
    skipped = "skipped on the CPU: "
    return isinstance(text, str) and text.startswith(skipped) and len(text) > len(skipped)


def run_benchmark(script: str, *args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """benchmarks/SCRIPT.py ARGS run from the repository's root, as its doc's commands are; fails the test with the
    output's tail when it exits non-zero. Returns the finished run (its stdout holds the printed table). A smoke in
    Triton's interpreter is skipped under Triton 3.6 (the GPU machines'): its interpreter holds scalars as 1-element
    arrays, which current NumPy refuses as a loop's bound (`range(k_lo, k_hi, ...)`), so kernels with runtime
    trip counts fail there; 3.7 fixed it, and CI runs the newest Triton."""
    if (env or {}).get("TRITON_INTERPRET") == "1" and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 7):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop to a runtime bound (fixed in 3.7)")
    done = subprocess.run([sys.executable, f"benchmarks/{script}.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done
