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
