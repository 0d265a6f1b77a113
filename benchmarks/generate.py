"""End-to-end generation throughput: our engine vs Hugging Face transformers `generate` on the same random
bf16 weights of a Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14/2 heads, vocab 151936, tied).

Fixed batches (128-token random prompts, 256 new tokens, ignore_eos) at batch 1/32/128/256, and a mixed
workload (256 requests, prompts 100..1024, outputs 100..1024, all arriving at once). HF runs 32 new tokens
per batch (it is slow) and its throughput is scaled from that; its largest cases are skipped when too slow.

--device cpu runs the same path on a tiny Qwen2 (TINY_CONFIG) in float32, HF on the same weights: 16-token prompts
at batch 1 and 2, 8 new tokens, and 4 mixed requests (prompts and outputs 4..32); --quick changes nothing there. Its
numbers only show that the path works (CI: tests/test_generate_benchmark.py).

python benchmarks/generate.py [--out DIR] [--quick]
python benchmarks/generate.py --device cpu  # the smoke CI runs
"""
import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bar_chart import grouped_bars  # noqa: E402
from benchmarks.provenance import git_commit  # noqa: E402
from benchmarks.timing import synchronize  # noqa: E402
from service.config import DEFAULT_MODEL_DIR  # noqa: E402
from service.engine.llm import LLM  # noqa: E402
from service.protocol import SamplingParams  # noqa: E402

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643,
    "use_sliding_window": False, "sliding_window": 32768,
}
# Llama-3.2-1B's shape (GQA 32/8, head_dim 64, llama3 rope scaling, tied embeddings)
LLAMA_1B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001,
}
WEIGHT_BYTES_FLOOR_MS = 0.33  # ~0.99 GB of bf16 weights read once per decode step at ~3 TB/s
PROMPT_LEN, NEW_TOKENS, HF_NEW_TOKENS = 128, 256, 32
# The CPU smoke's model: CONFIG's family at toy size, its vocabulary the embedded tokenizer's (which
# write_checkpoint copies), so that every token id has a token; bos/eos are that tokenizer's.
TINY_CONFIG = CONFIG | {"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 0, "eos_token_id": 2}
# What a run measures: the checkpoint, the dtype both engines run in, the batches, new tokens for ours and for HF,
# the prompt length, the mixed workload (requests; prompt and output lengths drawn from lo..hi, or None), HF's
# time budget in seconds and the decode step's weight-read floor (None where it was not worked out).
GPU_RUN = {"config": CONFIG, "label": "Qwen2.5-0.5B-shaped, random bf16", "dtype": "bfloat16",
           "batches": [1, 32, 128, 256], "new_tokens": NEW_TOKENS, "hf_new_tokens": HF_NEW_TOKENS,
           "prompt_len": PROMPT_LEN, "mixed": (256, 100, 1024), "hf_budget_s": 120, "floor_ms": WEIGHT_BYTES_FLOOR_MS}
RUNS = {"cuda": GPU_RUN,
        "cuda_quick": GPU_RUN | {"batches": [1, 32], "new_tokens": 64, "mixed": None, "hf_budget_s": 30},
        "cpu": {"config": TINY_CONFIG, "label": "tiny Qwen2 (2 layers, hidden 64), random bf16 weights in float32",
                "dtype": "float32", "batches": [1, 2], "new_tokens": 8, "hf_new_tokens": 8, "prompt_len": 16,
                "mixed": (4, 4, 32), "hf_budget_s": 30, "floor_ms": None}}


def write_checkpoint(path: Path, config: dict = CONFIG, device: str = "cuda") -> None:
    """Random bf16 weights in `config`'s shape (q/k/v biases for Qwen2), and the embedded model's tokenizer. Drawn
    by a seeded generator on `device`: each device's draws differ, but on one device they are the same every run."""
    from safetensors.torch import save_file

    c = config
    bias = c["architectures"][0] == "Qwen2ForCausalLM"
    g = torch.Generator(device=device).manual_seed(0)
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=device) * std).to(torch.bfloat16).cpu()

    w = {"model.embed_tokens.weight": rand(c["vocab_size"], h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if bias:
            w |= {p + "self_attn.q_proj.bias": rand(q), p + "self_attn.k_proj.bias": rand(kv),
                  p + "self_attn.v_proj.bias": rand(kv)}
        w |= {p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
              p + "self_attn.v_proj.weight": rand(kv, h),
              p + "self_attn.o_proj.weight": rand(h, q), p + "mlp.gate_proj.weight": rand(inter, h),
              p + "mlp.up_proj.weight": rand(inter, h), p + "mlp.down_proj.weight": rand(h, inter),
              p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # only loaded; outputs are not detokenized
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)


def run_engine(llm: LLM, prompts: list[list[int]], new_tokens: list[int]) -> dict:
    """Runs all requests (arriving at once) to completion; per-step and per-request timings."""
    engine = llm.engine
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, new_tokens)):
        engine.add_request(f"b{i}", p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    first, generated, decode_steps, step_times = {}, 0, [], []
    while engine.has_work:
        t = time.perf_counter()
        outputs, stats = engine.step()
        now = time.perf_counter()
        step_times.append(now - t)
        for out in outputs:
            first.setdefault(out.request_id, now - start)
        generated += len(outputs)
        if stats is not None and stats.num_prefill_tokens == 0:
            decode_steps.append((stats.batch_size, stats.step_seconds))
    elapsed = time.perf_counter() - start
    assert generated == sum(new_tokens), (generated, sum(new_tokens))
    ttft = sorted(first.values())
    full = [t for b, t in decode_steps if b == max(b for b, _ in decode_steps)] if decode_steps else [0.0]
    return {"seconds": elapsed, "tokens": generated, "tok_per_s": generated / elapsed,
            "ttft_median_ms": 1e3 * ttft[len(ttft) // 2], "ttft_p99_ms": 1e3 * ttft[int(0.99 * (len(ttft) - 1))],
            "decode_step_median_ms": 1e3 * sorted(full)[len(full) // 2], "steps": len(step_times),
            "step_seconds_total": sum(step_times), "step_max_ms": 1e3 * max(step_times)}


def run_hf(model, batch: int, new_tokens: int, prompt_len: int = PROMPT_LEN) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=model.device)
    synchronize(model.device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    synchronize(model.device)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tokens": batch * new_tokens, "tok_per_s": batch * new_tokens / elapsed}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--quick", action="store_true", help="batches 1 and 32, 64 new tokens, no mixed workload")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = RUNS["cuda_quick" if args.device == "cuda" and args.quick else args.device]
    config, batches, prompt_len = run["config"], run["batches"], run["prompt_len"]
    tmp = Path(tempfile.mkdtemp(prefix="bench-qwen2-"))
    results = {"config": run["label"], "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "commit": git_commit(), "weight_read_floor_ms": run["floor_ms"], "ours": {}, "hf": {}}
    try:
        write_checkpoint(tmp, config, args.device)
        t = time.perf_counter()
        llm = LLM(str(tmp), device=args.device, dtype=run["dtype"], max_num_seqs=256, max_num_batched_tokens=8192,
                  gpu_memory_utilization=0.6, max_model_len=4096)
        results["engine_startup_s"] = time.perf_counter() - t
        g = torch.Generator().manual_seed(0)
        rand = lambda n: torch.randint(0, config["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
        # The engine tuned its prefill buckets at start-up; one small batch settles the rest.
        run_engine(llm, [rand(prompt_len) for _ in range(8)], [16] * 8)
        for batch in batches:
            r = run_engine(llm, [rand(prompt_len) for _ in range(batch)], [run["new_tokens"]] * batch)
            results["ours"][f"batch{batch}"] = r
            print(f"ours  batch {batch:4d}: {r['tok_per_s']:9.0f} tok/s  "
                  f"decode step {r['decode_step_median_ms']:.2f} ms"
                  f"  TTFT median {r['ttft_median_ms']:.1f} ms", flush=True)
        if run["mixed"]:
            count, lo, hi = run["mixed"]
            lens = torch.randint(lo, hi + 1, (count, 2), generator=g).tolist()
            r = run_engine(llm, [rand(p) for p, _ in lens], [n for _, n in lens])
            results["ours"]["mixed"] = r
            print(f"ours  mixed     : {r['tok_per_s']:9.0f} tok/s  TTFT median {r['ttft_median_ms']:.0f} ms "
                  f"p99 {r['ttft_p99_ms']:.0f} ms", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()

        from transformers import AutoModelForCausalLM
        dtype = getattr(torch, run["dtype"])
        hf = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=dtype).to(args.device).eval()
        run_hf(hf, 1, 4, prompt_len)
        budget_end = time.perf_counter() + run["hf_budget_s"]
        hf_new_tokens = run["hf_new_tokens"]
        for batch in batches:
            if time.perf_counter() > budget_end:
                print(f"hf    batch {batch:4d}: skipped (time budget)")
                continue
            r = run_hf(hf, batch, hf_new_tokens, prompt_len)
            results["hf"][f"batch{batch}"] = r
            print(f"hf    batch {batch:4d}: {r['tok_per_s']:9.0f} tok/s ({hf_new_tokens} new tokens)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{'case':>10} {'ours tok/s':>11} {'HF tok/s':>10} {'speedup':>8} {'step ms':>8} {'x floor':>8} "
          f"{'TTFT ms':>8}")
    for case, r in results["ours"].items():
        hf_r = results["hf"].get(case)
        speedup = f"{r['tok_per_s'] / hf_r['tok_per_s']:.1f}x" if hf_r else "-"
        hf_s = f"{hf_r['tok_per_s']:.0f}" if hf_r else "-"
        step, floor = r["decode_step_median_ms"], run["floor_ms"]
        x_floor = f"{step / floor:.1f}" if floor else "-"
        print(f"{case:>10} {r['tok_per_s']:11.0f} {hf_s:>10} {speedup:>8} {step:8.2f} "
              f"{x_floor:>8} {r['ttft_median_ms']:8.1f}")
    (out / "generate.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "generate.png")
    print(f"wrote {out / 'generate.json'} and {out / 'generate.png'}")


def plot(results, path):
    cases = list(results["ours"])
    series = {"ours": [results["ours"][c]["tok_per_s"] for c in cases],
              "HF transformers": [results["hf"].get(c, {}).get("tok_per_s", 0) for c in cases]}
    grouped_bars(path, cases, series, "generated tokens / s",
                 f"Generation throughput, {results['config']} ({results['gpu']})", log=True, figsize=(8, 4.5))


if __name__ == "__main__":
    main()
