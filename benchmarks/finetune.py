"""Fine-tuning on the GPU with a Qwen2.5-0.5B-shaped random bf16 model (hidden 896, 24 layers, 14/2 heads,
vocab 151936): LoRA training tokens/s and peak memory for a few batch shapes, then the inter-token latency of
decode streams served by the engine alone, and while a fine-tuning job runs beside them (the default duty cycle
0.5, and 1.0 = training never pauses for serving).

python benchmarks/finetune.py [--out DIR]
"""
import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from service.config import DEFAULT_MODEL_DIR, Settings  # noqa: E402
from service.finetune.data import Example  # noqa: E402
from service.finetune.trainer import StepResult, TrainConfig, Trainer  # noqa: E402
from service.model.loader import load_model  # noqa: E402
from service.model.lora import LoRAConfig  # noqa: E402

CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
          "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
          "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 2, "bos_token_id": 0}
TRAIN_SHAPES = [(8, 512), (4, 2048), (16, 1024)]  # (sequences per micro-batch, tokens per sequence)
LORA = LoRAConfig(rank=16, alpha=32)
STREAMS, PROMPT_TOKENS, NEW_TOKENS = 8, 128, 256
WINDOW_SECONDS = 10  # serving window per condition: long enough for the job's counters to move


def write_model(path: Path) -> Path:
    """Random weights (std 0.02) in an HF-style directory, with the embedded model's tokenizer files."""
    from service.model import LlamaForCausalLM, ModelConfig

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    with torch.device("cuda"):
        model = LlamaForCausalLM(ModelConfig.from_dict(CONFIG)).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return path


def random_examples(n: int, length: int, vocab: int) -> list[Example]:
    return [Example(torch.randint(3, vocab, (length,)).tolist(), [True] * length) for _ in range(n)]


def bench_training(model_dir: Path) -> list[dict]:
    model = load_model(model_dir, torch.bfloat16, "cuda")
    rows = []
    for micro, length in TRAIN_SHAPES:
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        examples = random_examples(micro * 8, length, CONFIG["vocab_size"])
        trainer = Trainer(model, examples, TrainConfig(learning_rate=1e-4, batch_size=micro, micro_batch_size=micro,
                                                       n_epochs=1), LORA)
        steps = (r for r in trainer.micro_batches() if isinstance(r, StepResult))
        for _ in range(2):  # warm-up: Triton autotuning and compilation
            next(steps)
        torch.cuda.synchronize()
        start, tokens = time.perf_counter(), 0
        for result in steps:
            tokens += result.tokens
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows.append({"micro_batch": micro, "seq_len": length, "tokens_per_s": tokens / seconds,
                     "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                     "training_memory_gib": (torch.cuda.max_memory_allocated() - weights) / 2**30})
        del trainer
    del model
    torch.cuda.empty_cache()
    return rows


async def decode_gaps(client) -> list[float]:
    """Inter-token gaps (s) of STREAMS concurrent greedy streams, as a front-end receives them."""
    from service.protocol import SamplingParams

    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    async def one(i):
        prompt = [random.randrange(3, 3000) for _ in range(PROMPT_TOKENS)]
        stream = await client.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
        gaps, last = [], None
        async for batch in stream.batches():
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            gaps += [0.0] * (len(batch) - 1)
            last = now
        return gaps

    return [g for gaps in await asyncio.gather(*(one(i) for i in range(STREAMS))) for g in gaps]


def percentiles(gaps: list[float]) -> dict:
    t = torch.tensor(gaps) * 1000
    return {"p50_ms": t.quantile(0.5).item(), "p90_ms": t.quantile(0.9).item(), "p99_ms": t.quantile(0.99).item(),
            "mean_ms": t.mean().item()}


async def bench_serving(model_dir: Path, finetune_dir: Path) -> tuple[list[dict], dict]:
    """An engine core in a thread here (as in its own process when served) and the client a front-end uses."""
    import threading

    from prometheus_client import CollectorRegistry

    from service.api.engine_client import EngineClient
    from service.engine.core import EngineCore
    from service.finetune.data import parse_jsonl, save_examples, tokenize_records
    from service.metrics import FrontendMetrics

    settings = Settings(model=str(model_dir), max_model_len=4096, gpu_memory_utilization=0.5,
                        finetune_dir=str(finetune_dir))
    address = f"ipc://{finetune_dir.parent / 'core.sock'}"
    core = await asyncio.to_thread(EngineCore, settings, address)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    client = EngineClient(address, "bench", FrontendMetrics(CollectorRegistry()))
    await client.start()
    while not client.ready:
        await asyncio.sleep(0.05)
    words = [f"w{i}" for i in range(500)]
    data = "\n".join(json.dumps({"text": " ".join(random.choices(words, k=200))}) for _ in range(64)).encode()
    file_id = "file-bench"
    files = finetune_dir / "files"
    (files / f"{file_id}.jsonl").write_bytes(data)
    save_examples(files, file_id, tokenize_records(parse_jsonl(data), client.tokenizer, client.max_model_len))
    await client.call("register_file", meta={"id": file_id, "object": "file", "bytes": len(data), "created_at": 0,
                                             "filename": "bench.jsonl", "purpose": "fine-tune", "status": "processed"})
    await decode_gaps(client)  # warm-up
    rows, gap_samples = [], {}
    for label, duty in [("serving alone", None), ("+ training, duty 0.5", 0.5), ("+ training, duty 1.0", 1.0)]:
        job = None
        if duty is not None:
            settings.finetune_duty_cycle = duty  # read by the core's job manager before each pause
            job = await client.call("create_job", num_examples=64, body={
                "model": client.model_name, "training_file": file_id, "hyperparameters": {"n_epochs": 100,
                                                                                           "batch_size": 8},
                "extra": {"lora_rank": LORA.rank, "lora_alpha": LORA.alpha, "gradient_accumulation_steps": 2}})
            while job["status"] != "running" or not job["trained_tokens"]:
                await asyncio.sleep(0.1)
                job = await client.call("get_job", job_id=job["id"])
        tokens_before = job["trained_tokens"] if job else 0
        start = time.perf_counter()
        gaps = []
        while not gaps or time.perf_counter() - start < WINDOW_SECONDS:  # several optimizer steps of the job
            gaps += await decode_gaps(client)
        seconds = time.perf_counter() - start
        row = {"condition": label, **percentiles(gaps), "decode_tokens_per_s": len(gaps) / seconds}
        if job is not None:
            job = await client.call("get_job", job_id=job["id"])
            row["training_tokens_per_s"] = (job["trained_tokens"] - tokens_before) / seconds
            await client.call("cancel_job", job_id=job["id"])
            await asyncio.sleep(2)  # the job stops before its next micro-batch
        rows.append(row)
        gap_samples[label] = gaps
    await client.close()
    core.stop()
    thread.join()
    return rows, gap_samples


def plot(train_rows, serve_rows, gap_samples, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['micro_batch']}x{r['seq_len']}" for r in train_rows]
    bars = a.bar(labels, [r["tokens_per_s"] / 1000 for r in train_rows])
    for bar, r in zip(bars, train_rows):
        a.annotate(f"{r['peak_memory_gib']:.1f} GiB", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                   ha="center", va="bottom", fontsize=8)
    a.set(xlabel="micro-batch (sequences x tokens)", ylabel="k tokens/s",
          title=f"LoRA r={LORA.rank} training, Qwen2.5-0.5B shape (label: peak memory)")
    for label, gaps in gap_samples.items():
        t = torch.tensor(sorted(gaps)) * 1000
        b.plot(t, torch.linspace(0, 1, len(t)), label=label)
    b.set(xscale="log", xlabel="inter-token latency (ms)", ylabel="CDF",
          title=f"{STREAMS} decode streams, with and without a training job")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(0)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "qwen2.5-0.5b-random")
        train_rows = bench_training(model_dir)
        print(f"{'micro-batch':>12} {'seq':>6} {'tokens/s':>10} {'peak GiB':>9} {'train GiB':>9}")
        for r in train_rows:
            print(f"{r['micro_batch']:>12} {r['seq_len']:>6} {r['tokens_per_s']:>10.0f} {r['peak_memory_gib']:>9.2f}"
                  f" {r['training_memory_gib']:>9.2f}")
        serve_rows, gaps = asyncio.run(bench_serving(model_dir, Path(tmp) / "finetune"))
    print(f"\n{'condition':<22} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'decode tok/s':>12} {'train tok/s':>11}")
    for r in serve_rows:
        print(f"{r['condition']:<22} {r['p50_ms']:>7.2f} {r['p90_ms']:>7.2f} {r['p99_ms']:>7.2f} "
              f"{r['decode_tokens_per_s']:>12.0f} {r.get('training_tokens_per_s', 0):>11.0f}")
    result = {"device": torch.cuda.get_device_name(), "model": CONFIG, "lora": {"rank": LORA.rank, "alpha": LORA.alpha,
              "targets": list(LORA.targets)}, "training": train_rows, "serving": serve_rows,
              "streams": STREAMS, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS}
    (out / "finetune.json").write_text(json.dumps(result, indent=2))
    plot(train_rows, serve_rows, gaps, out / "finetune.png")
    print(f"wrote {out / 'finetune.json'} and {out / 'finetune.png'}")


if __name__ == "__main__":
    main()
