"""Timing shared by the benchmarks: GPU timing, and the wall clock of their CPU smokes."""
import time

import torch

from kernels.pdl_primer import prime as prime_pdl
from kernels.pdl_primer import wants_primer


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 50, warmup_s: float = 0.05, prime: bool = True) -> float:
    """GPU milliseconds of one replay of a captured CUDA graph: CUDA events around back-to-back replays, after
    replaying it for warmup_s. prime: launch kernels/pdl_primer.py's kernel first, as the engine does before each
    replay (without it a graph timed after engine steps of a new request reads slower than after a capture)."""
    device = torch.device("cuda", torch.cuda.current_device())
    if prime and wants_primer(device):
        prime_pdl(device)
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / replays


def kernel_us(fn, calls: int = 1) -> tuple[int, dict[str, float]]:
    """Kernels one call of fn launches, and the GPU microseconds of each kernel name per call, from `calls` calls
    under torch.profiler after one to warm up (memory copies and sets left out). Where fn replays a graph, a
    kernel's time includes what it waits for under programmatic dependent launch."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    times: dict[str, float] = {}
    for e in kernels:
        times[e.name[:60]] = times.get(e.name[:60], 0.0) + e.device_time / calls
    return len(kernels) // calls, times


def replay_kernel_us(graph: torch.cuda.CUDAGraph, replays: int = 10, top: int = 12) -> dict[str, float]:
    """GPU microseconds per replay of the `top` kernel names of a captured CUDA graph: where its time goes."""
    times = kernel_us(graph.replay, replays)[1]
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:top])


def synchronize(device) -> None:
    """Waits for the queued work of a CUDA `device` (a name or a torch.device); a call on the CPU is done when it
    returns."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn, reps: int = 3, warmup: int = 1, device="cpu", until_done: bool = True) -> float:
    """Median wall-clock milliseconds of one call of fn, after `warmup` calls, each timed from an idle `device` to
    the end of its work: on the CPU the smokes' stand-in for CUDA events and do_bench, whose numbers only show that
    the call ran (Triton's interpreter times nothing real); on the GPU a call's host and GPU time together.
    until_done False: each call timed to its return, its host time alone (the device drained after the last)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        if until_done:
            synchronize(device)
        times.append(time.perf_counter() - start)
    synchronize(device)
    return 1e3 * sorted(times)[reps // 2]
