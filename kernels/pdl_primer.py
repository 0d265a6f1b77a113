"""A kernel that does nothing, launched with programmatic dependent launch right before the engine replays a CUDA
graph: the graphs' kernels then overlap as they did when captured.

Found by measurement, not from documentation (H200, driver 580.159.04, torch 2.11, Triton 3.6, 2026-11-30): the
decode graphs replayed 4-7% slower inside the engine than right after their capture. The slow state begins in the
steps that start and end a request (decode steps alone keep the state they find), lasts through any number of the
graph's own replays (its kernels launched with PDL inside it do not end it), and ends at the next eager launch of a
Triton kernel with PDL; a plain Triton launch, cuBLAS or torch kernels, copies, events, sleeps, `empty_cache` and
other graphs' replays leave it as it is. Under torch.profiler the slow replays run the same kernels, no longer in
sum, but overlap them less under PDL (459 against 544 us of overlap per batch-1 step) and leave longer gaps between
the first, plain ones (0.4 against 0.1 us). What holds the state is not known, so the engine ends it before every
replay: a launch that costs less than it gains (2,000 launched back to back took 10-13 us each, host and GPU alike).
The engine's steady decode step with it against without (84e2744, H200, Qwen2.5-0.5B shape, random weights;
benchmarks/step_profile.py's decode section measures both): 0.727 / 0.758 ms at batch 1, 1.075 / 1.157 at 64,
1.447 / 1.512 at 256.
"""
import torch
import triton
import triton.language as tl

from kernels.configs import gdc_wait, pdl_launch
from kernels.launches import KernelLaunches


@triton.jit
def _primer_kernel(X, PDL: tl.constexpr):
    if PDL:  # kernels/configs.py
        gdc_wait()


_LAUNCHES = KernelLaunches(_primer_kernel)
_TARGETS: dict[torch.device, torch.Tensor] = {}


def wants_primer(device: torch.device) -> bool:
    """Whether graphs replayed on `device` need the primer: CUDA with PDL (Hopper and later, kernels/configs.py)."""
    return pdl_launch(device).get("launch_pdl", False)


def prime(device: torch.device) -> None:
    """Launches the primer on `device`'s current stream (see the module's doc); only where wants_primer(device)."""
    target = _TARGETS.get(device)
    if target is None:  # the kernel reads nothing, but Triton's launch takes an argument
        target = _TARGETS[device] = torch.empty(1, device=device)
    _LAUNCHES.launch((1,), (target,), {"PDL": True}, launch_pdl=True)
