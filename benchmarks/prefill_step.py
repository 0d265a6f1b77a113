"""Where an eager prefill step's time goes (it is the time to first token): the step's wall time against its GPU
time, the host time of one call of our varlen attention, and the host ops that cost most (torch.profiler).

python benchmarks/prefill_step.py [--tokens 128] [--out DIR]

Uses the Qwen2.5-0.5B-shaped random bf16 checkpoint of benchmarks/generate.py, one sequence, no CUDA graphs.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.generate import write_checkpoint  # noqa: E402
from service.engine.llm import LLM  # noqa: E402


def median_ms(fn, repeat: int = 50) -> float:
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    write_checkpoint(tmp)
    llm = LLM(str(tmp), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=4096, cuda_graphs=False)
    runner, model = llm.engine.runner, llm.engine.model
    n = args.tokens
    tables = [list(range(-(-n // runner.block_size)))]

    @torch.inference_mode()
    def step():
        ids, positions, meta = runner._inputs(list(range(3, n + 3)), [n], [n], tables)
        model.compute_logits(model(ids, positions, meta)[-1:]).argmax(-1).tolist()

    step()
    wall = median_ms(step)

    from kernels import flash_attn_varlen_func
    attn = model.model.layers[0].self_attn
    with torch.inference_mode():
        ids, positions, meta = runner._inputs(list(range(3, n + 3)), [n], [n], tables)
        q = torch.randn(n, attn.num_heads, attn.head_dim, device="cuda", dtype=torch.bfloat16)
        call = lambda: flash_attn_varlen_func(q, attn.k_cache, attn.v_cache, meta.cu_seqlens_q,  # noqa: E731
                                              meta.cu_seqlens_k, n, n, softmax_scale=attn.scale, causal=True,
                                              block_table=meta.block_table)
        call()
        host = []
        for _ in range(200):
            t = time.perf_counter()
            call()
            host.append(time.perf_counter() - t)
        attention_host_us = 1e6 * sorted(host)[100]
        attention_ms = median_ms(call)

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
    averages = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in averages) / 5 / 1e3
    table = averages.table(sort_by="self_cpu_time_total", row_limit=25)
    result = {"gpu": torch.cuda.get_device_name(), "tokens": n, "layers": model.config.num_hidden_layers,
              "step_wall_ms": wall, "step_gpu_ms": gpu_ms, "attention_call_host_us": attention_host_us,
              "attention_call_wall_ms": attention_ms}
    print(table)
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_step.json").write_text(json.dumps({**result, "profile": table}, indent=1))


if __name__ == "__main__":
    main()
