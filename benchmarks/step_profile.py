"""Where an engine step's host time goes. Prefill (the time to first token): an eager step's wall time against
its GPU time, the host time of one call of our varlen attention, the host ops that cost most (torch.profiler),
and the engine's own time to first token (add_request to the first sampled token, prefill graphs included) with
where its host time goes. Decode: the wall time of overlapped steps at a few batch sizes and the Python functions
that cost most (cProfile), to set against the decode graph's GPU time; and at batch 64 with 3 sequences on a LoRA
adapter.

python benchmarks/step_profile.py [--tokens 128] [--out DIR]

Uses the Qwen2.5-0.5B-shaped random bf16 checkpoint of benchmarks/generate.py. Writes step_profile.json.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.generate import write_checkpoint  # noqa: E402
from service.engine.llm import LLM  # noqa: E402
from service.protocol import SamplingParams  # noqa: E402


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
    llm = LLM(str(tmp), dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=4096)
    runner, model = llm.engine.runner, llm.engine.model
    n = args.tokens
    tables = [list(range(-(-n // runner.block_size)))]

    @torch.inference_mode()
    def step():
        ids, positions, meta, _ = runner._inputs(list(range(3, n + 3)), [n], [n], tables)
        model.compute_logits(model(ids, positions, meta)[-1:]).argmax(-1).tolist()

    step()
    wall = median_ms(step)

    from kernels import flash_attn_varlen_func
    attn = model.model.layers[0].self_attn
    with torch.inference_mode():
        ids, positions, meta, _ = runner._inputs(list(range(3, n + 3)), [n], [n], tables)
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
    result |= engine_ttft(llm, n)
    decode = {batch: decode_profile(llm, batch) for batch in (1, 64, 256)}
    result["decode_step_ms_with_adapter"] = lora_decode_step_ms(llm, 64, adapter_rows=3)
    print(table)
    for batch, d in decode.items():
        print(f"decode batch {batch}: {d['step_ms']:.3f} ms per step\n{d['profile']}")
    result["decode_step_ms"] = {batch: d["step_ms"] for batch, d in decode.items()}
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_profile.json").write_text(json.dumps(
        {**result, "prefill_profile": table, "decode_profiles": {b: d["profile"] for b, d in decode.items()}},
        indent=1))


def engine_ttft(llm, tokens: int, requests: int = 30) -> dict:
    """The engine's share of the time to first token: add_request of a fresh prompt (no prefix hit) on an idle
    engine, stepped until its first token, median over requests; and where that host time goes (cProfile)."""
    engine, params = llm.engine, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    times, profile = [], cProfile.Profile()
    for i in range(requests):
        prompt = torch.randint(3, engine.model.config.vocab_size, (tokens,), generator=g).tolist()
        torch.cuda.synchronize()
        if i >= requests // 2:
            profile.enable()
        start = time.perf_counter()
        engine.add_request(f"ttft-{i}", prompt, params)
        while not any(out.request_id == f"ttft-{i}" for out in engine.step()[0]):
            pass
        times.append(time.perf_counter() - start)
        profile.disable()
        while engine.has_work:
            engine.step()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    print(f"engine TTFT ({tokens}-token prompt): {1e3 * sorted(times)[len(times) // 2]:.2f} ms\n{text.getvalue()}")
    return {"engine_ttft_ms": 1e3 * sorted(times)[len(times) // 2], "prefill_graphs": len(engine.runner.prefill_graphs),
            "engine_ttft_profile": text.getvalue()[-3500:]}


def _decode_steps(engine, batch: int, steps: int, adapter_rows: int = 0) -> float:
    """Starts `batch` requests (the first adapter_rows on the adapter "profile"), runs them into steady decoding,
    and returns the mean wall time of the next `steps` overlapped steps."""
    params = SamplingParams(max_new_tokens=4 * steps, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{batch}-{adapter_rows}-{i}", list(range(3, 131)), params,
                           adapter="profile" if i < adapter_rows else None)
    for _ in range(10):  # the prefill and the first decodes
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1e3 * (time.perf_counter() - start) / steps


def _finish(engine) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_work:
        engine.step()


def lora_decode_step_ms(llm, batch: int, adapter_rows: int, steps: int = 200) -> float:
    """Mean decode step at this batch when adapter_rows of its sequences ask for a (random, rank 8) LoRA adapter,
    against decode_profile's steps without: a step with an adapter runs eagerly, with the adapter's hooks."""
    from service.model.lora import Adapter, LoRAConfig, add_adapter

    engine = llm.engine
    adapter = Adapter.init(engine.model, LoRAConfig(rank=8), seed=0)
    add_adapter(engine.model, "profile", adapter.to(engine.device, engine.model.lm_head.weight.dtype))
    step_ms = _decode_steps(engine, batch, steps, adapter_rows)
    _finish(engine)
    print(f"decode batch {batch} with {adapter_rows} adapter rows: {step_ms:.3f} ms per step")
    return step_ms


def decode_profile(llm, batch: int, steps: int = 200) -> dict:
    """Mean wall time of decode steps at this batch (overlapped, CUDA graphs), then the same steps under cProfile."""
    engine = llm.engine
    step_ms = _decode_steps(engine, batch, steps)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    _finish(engine)
    return {"step_ms": step_ms, "profile": text.getvalue()[-3500:]}


if __name__ == "__main__":
    main()
