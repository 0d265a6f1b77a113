"""GPU timing shared by the benchmarks."""
import torch


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 50) -> float:
    """GPU milliseconds of one replay of a captured CUDA graph: CUDA events around back-to-back replays, after
    three to warm up."""
    for _ in range(3):
        graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / replays


def replay_kernel_us(graph: torch.cuda.CUDAGraph, replays: int = 10, top: int = 12) -> dict[str, float]:
    """GPU microseconds per replay of each kernel name in a captured CUDA graph (torch.profiler), the `top` ones:
    where a graph's time goes."""
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]] = times.get(e.name[:60], 0.0) + e.device_time / replays
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:top])
