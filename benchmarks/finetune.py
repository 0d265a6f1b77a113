"""Fine-tuning: LoRA training throughput of our trainer beside transformers + PEFT on the same model, then the
inter-token latency of decode streams served by the engine alone and while a fine-tuning job runs beside them (the
default duty cycle 0.5, and 1.0 = training never pauses for serving).

On the GPU: a random bf16 Qwen2.5-0.5B-shaped checkpoint (hidden 896, 24 layers, 14/2 heads, vocab 151936), LoRA
rank 16 / alpha 32 on all 7 projections, AdamW, one micro-batch of 8x512, 4x2048 or 16x1024 (sequences x tokens)
per optimizer step. transformers + PEFT train the same checkpoint, loaded with SDPA attention (and flash-attn 2
where `import flash_attn` works), as its Trainer does with bf16=True: adapter weights float32 (PEFT's default),
forward under torch.autocast(bfloat16); our adapters are float32 too (AdamW's master copy; the forward reads bf16
copies renewed after each optimizer step). Per shape the
runs take turns (ours, PEFT, ours, PEFT), each from a fresh load with nothing else on the GPU and freed after, and
each side keeps its faster run. What is counted (the JSON's "definitions" says the same):
- tokens/s: every token of the timed optimizer steps' sequences (micro-batch x length per step, targets or not),
  over their wall time, after warm-up steps;
- MFU: model FLOPs per token x tokens/s over 989 TFLOP/s (H100 SXM, bf16 dense; the H200's is the same). Model
  FLOPs per token: 4 N (forward and input-gradient backward through the frozen weights: N = every projection of every
  layer plus the LM head, biases and norms left out) + 6 r (in + out) per adapted projection (LoRA forward, input
  and weight gradients) + 7 S d h per layer (causal attention at S tokens per sequence: forward 2 S^2 d h per
  sequence, backward 2.5x);
- peak memory: torch.cuda.max_memory_allocated over the run (weights, adapter, optimizer state, activations).

--device cpu: the same steps on a tiny random Qwen2-shaped float32 model, tiny shapes, a short serving window and no
plot: the host side, run by tests/test_finetune_benchmark.py. --profile adds torch.profiler tables of our steps;
--plain-loss a third side, our trainer with the plain loss over whole logits (what service.finetune.loss saves).

python benchmarks/finetune.py [--device cpu] [--peers peft|none] [--profile] [--plain-loss] [--window SECONDS]
                              [--no-serving] [--out DIR]
"""
import argparse
import asyncio
import dataclasses
import functools
import gc
import importlib
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
from benchmarks.provenance import git_commit  # noqa: E402
from benchmarks.timing import synchronize  # noqa: E402
from service.config import DEFAULT_MODEL_DIR, Settings  # noqa: E402
from service.finetune.data import Example  # noqa: E402
from service.finetune.loss import linear_cross_entropy_ref  # noqa: E402
from service.finetune.trainer import StepResult, TrainConfig, Trainer  # noqa: E402
from service.model.loader import load_model  # noqa: E402
from service.model.lora import LoRAConfig  # noqa: E402

CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
          "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
          "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 2, "bos_token_id": 0}
# The CPU's model: the embedded tokenizer's vocabulary (the serving part tokenizes with it), everything else tiny.
TINY = {**CONFIG, "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "torch_dtype": "float32"}
LORA = LoRAConfig(rank=16, alpha=32)
TRAIN = TrainConfig(learning_rate=1e-4)  # AdamW's settings for both sides: lr, weight decay, gradient clipping
PEAK_TFLOPS = 989.0  # H100 SXM, bf16 dense (the H200's is the same)


def setup(device: str) -> dict:
    """What runs where: the model, training shapes, steps per run, and the serving load."""
    if device == "cpu":
        return dict(config=TINY, dtype=torch.float32, shapes=[(2, 32), (1, 64)], warmup=1, timed=2,
                    profile_shapes=[(1, 64)], streams=2, prompt_tokens=16, new_tokens=8, window=1.0,
                    max_model_len=1024)
    return dict(config=CONFIG, dtype=torch.bfloat16, shapes=[(8, 512), (4, 2048), (16, 1024)], warmup=2, timed=6,
                profile_shapes=[(4, 2048), (8, 512)], streams=8, prompt_tokens=128, new_tokens=256, window=10.0,
                max_model_len=4096)


def write_model(path: Path, config: dict, dtype: torch.dtype, device: str) -> Path:
    """Random weights (std 0.02) in an HF-style directory, with the embedded model's tokenizer files."""
    from service.model import LlamaForCausalLM, ModelConfig

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    with torch.device(device):
        model = LlamaForCausalLM(ModelConfig.from_dict(config)).to(dtype)
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


def flops_per_token(config: dict, seq_len: int) -> float:
    """Model FLOPs of one token of a LoRA training step (the module docstring says what is counted)."""
    h, inter, layers, heads = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                    "num_attention_heads"))
    d = h // heads
    q, kv = heads * d, config["num_key_value_heads"] * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    frozen = layers * sum(n_in * n_out for n_in, n_out in shapes.values()) + config["vocab_size"] * h
    adapter = layers * LORA.rank * sum(n_in + n_out for name, (n_in, n_out) in shapes.items() if name in LORA.targets)
    return 4 * frozen + 6 * adapter + 7 * seq_len * d * heads * layers


class Ours:
    """Our Trainer, one micro-batch per optimizer step."""

    def __init__(self, model_dir, dtype, device, examples, micro):
        model = load_model(model_dir, dtype, device)
        config = dataclasses.replace(TRAIN, batch_size=micro, micro_batch_size=micro, n_epochs=1)
        trainer = Trainer(model, examples, config, LORA)
        self.steps = (r for r in trainer.micro_batches() if isinstance(r, StepResult))

    def step(self) -> None:
        next(self.steps)


class OursPlainLoss(Ours):
    """Ours with the loss of before service.finetune.loss: F.cross_entropy over the whole [tokens, vocab] logits."""

    def step(self) -> None:
        from service.finetune import trainer

        chunked, trainer.linear_cross_entropy = trainer.linear_cross_entropy, linear_cross_entropy_ref
        try:
            super().step()
        finally:
            trainer.linear_cross_entropy = chunked


class Peft:
    """transformers + PEFT as its Trainer runs a step with bf16=True (autocast), same optimizer settings as ours."""

    def __init__(self, model_dir, dtype, device, examples, micro, attention):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)
        model.config.use_cache = False
        model.train()
        self.model = get_peft_model(model.to(device), LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0,
                                                                 target_modules=list(LORA.targets)))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=TRAIN.learning_rate, weight_decay=TRAIN.weight_decay,
                                           fused=device == "cuda")
        self.device, self.dtype = device, dtype
        self.batches = iter([examples[i:i + micro] for i in range(0, len(examples), micro)])

    def step(self) -> None:
        ids = torch.tensor([ex.token_ids for ex in next(self.batches)]).to(self.device)
        with torch.autocast(self.device, self.dtype, enabled=self.dtype != torch.float32):
            loss = self.model(input_ids=ids, labels=ids).loss  # its own loss: mean over the shifted labels
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, TRAIN.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # a wait per step, as ours has


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def timed_run(make, device: str, warmup: int, timed: int) -> dict:
    """Builds a run (its model loaded fresh), times `timed` steps after `warmup`, and frees it."""
    free(device)
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run = make()
    for _ in range(warmup):  # Triton autotuning and compilation, cuBLAS heuristics, the allocator's first blocks
        run.step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(timed):
        run.step()
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if device == "cuda" else None
    del run
    free(device)
    return {"seconds": seconds, "peak_memory_gib": peak}


def imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # missing, or built for another torch or CUDA
        return False
    return True


def systems(args) -> dict:
    """Name -> how to build a run of it: (model_dir, dtype, device, examples, micro) -> object with step()."""
    found = {"ours": Ours}
    if args.plain_loss:
        found["ours_plain_loss"] = OursPlainLoss
    if args.peers == "peft":
        found["peft_sdpa"] = lambda *a: Peft(*a, attention="sdpa")
        if args.device == "cuda" and imports("flash_attn"):
            found["peft_flash_attn_2"] = lambda *a: Peft(*a, attention="flash_attention_2")
    return found


def bench_training(model_dir: Path, args, s: dict) -> list[dict]:
    runners, rows = systems(args), []
    for micro, length in s["shapes"]:
        examples = random_examples(micro * (s["warmup"] + s["timed"]), length, s["config"]["vocab_size"])
        tokens = micro * length * s["timed"]
        runs = {name: [] for name in runners}
        for _ in range(2):  # the sides take turns, twice: drift of clocks or the host falls on both
            for name, make in runners.items():
                build = functools.partial(make, model_dir, s["dtype"], args.device, examples, micro)
                runs[name].append(timed_run(build, args.device, s["warmup"], s["timed"]))
        flops = flops_per_token(s["config"], length)
        row = {"micro_batch": micro, "seq_len": length, "flops_per_token": flops}
        for name, results in runs.items():
            best = min(r["seconds"] for r in results)
            peaks = [r["peak_memory_gib"] for r in results if r["peak_memory_gib"] is not None]
            row[name] = {"tokens_per_s": tokens / best, "runs_tokens_per_s": [tokens / r["seconds"] for r in results],
                         "mfu": flops * tokens / best / (PEAK_TFLOPS * 1e12) if args.device == "cuda" else None,
                         "peak_memory_gib": max(peaks) if peaks else None}
        for name in [n for n in runners if n != "ours"]:
            row[f"speedup_vs_{name}"] = row["ours"]["tokens_per_s"] / row[name]["tokens_per_s"]
        rows.append(row)
        print_training_row(row, runners)
    return rows


def print_training_row(row: dict, runners) -> None:
    for name in runners:
        r = row[name]
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        peak = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
        runs = " / ".join(f"{t:.0f}" for t in r["runs_tokens_per_s"])
        print(f"{row['micro_batch']:>3}x{row['seq_len']:<5} {name:<18} {r['tokens_per_s']:>10.0f} tok/s "
              f"(runs {runs})  MFU {mfu:>6}  peak {peak} GiB")


def profile_training(model_dir: Path, args, s: dict, rows: list[dict]) -> list[dict]:
    """torch.profiler over a few of our steps per shape: kernels by GPU time, operators by the GPU time of the kernels
    they launch and by their own CPU time, and the GPU's busy time per step beside the step's unprofiled wall time
    (from the timed runs): a GPU busy for much less than the step waits on the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    steps, results = 3, []
    for micro, length in s["profile_shapes"]:
        examples = random_examples(micro * (s["warmup"] + steps), length, s["config"]["vocab_size"])
        free(args.device)
        run = Ours(model_dir, s["dtype"], args.device, examples, micro)
        for _ in range(s["warmup"]):
            run.step()
        synchronize(args.device)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                run.step()
            synchronize(args.device)
        del run
        free(args.device)
        events = prof.key_averages()
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        operators = [e for e in events if e.device_type == DeviceType.CPU]
        busy = sum(e.self_device_time_total for e in kernels) / steps / 1000
        timed = next((r for r in rows if (r["micro_batch"], r["seq_len"]) == (micro, length)), None)

        def top(found, key):
            return [{"name": e.key[:160], "calls_per_step": e.count / steps,
                     "gpu_ms_per_step": e.self_device_time_total / steps / 1000,
                     "cpu_ms_per_step": e.self_cpu_time_total / steps / 1000}
                    for e in sorted(found, key=key, reverse=True)[:20]]
        results.append({
            "micro_batch": micro, "seq_len": length, "steps": steps, "gpu_busy_ms_per_step": busy,
            "step_ms_unprofiled": micro * length / timed["ours"]["tokens_per_s"] * 1000 if timed else None,
            "cpu_self_ms_per_step": sum(e.self_cpu_time_total for e in operators) / steps / 1000,
            "kernels_per_step": sum(e.count for e in kernels) / steps,
            "kernels_by_gpu_time": top(kernels, lambda e: e.self_device_time_total),
            "operators_by_gpu_time": top(operators, lambda e: e.self_device_time_total) if kernels else [],
            "operators_by_cpu_time": top(operators, lambda e: e.self_cpu_time_total)})
        print_profile(results[-1])
    return results


def print_profile(p: dict) -> None:
    step = f"{p['step_ms_unprofiled']:.1f} ms unprofiled" if p["step_ms_unprofiled"] else "step time not measured"
    print(f"\nprofile {p['micro_batch']}x{p['seq_len']}: GPU busy {p['gpu_busy_ms_per_step']:.1f} ms per step "
          f"({step}), operators' own CPU time {p['cpu_self_ms_per_step']:.1f} ms per step (profiled), "
          f"{p['kernels_per_step']:.0f} kernels per step")
    for title in ("kernels_by_gpu_time", "operators_by_gpu_time", "operators_by_cpu_time"):
        if p[title]:
            print(f"{title:<100} {'calls':>6} {'GPU ms':>7} {'CPU ms':>7}  (per step)")
        for e in p[title]:
            print(f"{e['name'][:100]:<100} {e['calls_per_step']:>6.0f} {e['gpu_ms_per_step']:>7.2f} "
                  f"{e['cpu_ms_per_step']:>7.2f}")


async def decode_gaps(client, s: dict) -> list[float]:
    """Inter-token gaps (s) of the concurrent greedy streams, as a front-end receives them."""
    from service.protocol import SamplingParams

    params = SamplingParams(max_new_tokens=s["new_tokens"], temperature=0.0, ignore_eos=True)

    async def one(i):
        prompt = [random.randrange(3, 3000) for _ in range(s["prompt_tokens"])]
        (stream,) = await client.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
        gaps, last = [], None
        while not stream.finished or stream.waiting:
            await stream.ready.wait()
            stream.ready.clear()
            batch = stream.take()
            if stream.error is not None:
                raise stream.error
            if not batch:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            gaps += [0.0] * (len(batch) - 1)
            last = now
        return gaps

    return [g for gaps in await asyncio.gather(*(one(i) for i in range(s["streams"]))) for g in gaps]


def percentiles(gaps: list[float]) -> dict:
    t = torch.tensor(gaps) * 1000
    return {"p50_ms": t.quantile(0.5).item(), "p90_ms": t.quantile(0.9).item(), "p99_ms": t.quantile(0.99).item(),
            "mean_ms": t.mean().item()}


async def bench_serving(model_dir: Path, finetune_dir: Path, device: str, s: dict) -> tuple[list[dict], dict]:
    """An engine core in a thread here (as in its own process when served) and the client a front-end uses."""
    import threading

    from prometheus_client import CollectorRegistry

    from service.api.engine_client import EngineClient
    from service.engine.core import EngineCore
    from service.finetune.data import parse_jsonl, save_examples, tokenize_records
    from service.metrics import FrontendMetrics

    settings = Settings(model=str(model_dir), device=device, max_model_len=s["max_model_len"],
                        gpu_memory_utilization=0.5, finetune_dir=str(finetune_dir))
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
    await decode_gaps(client, s)  # warm-up
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
        while not gaps or time.perf_counter() - start < s["window"]:  # several optimizer steps of the job
            gaps += await decode_gaps(client, s)
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


def plot(train_rows, gap_samples, s, path):
    """Training tokens/s per shape and side; beside it, with gap samples (the serving part), their CDFs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if gap_samples else 1, figsize=(13 if gap_samples else 7, 4.5), squeeze=False)
    a = axes[0][0]
    labels = [f"{r['micro_batch']}x{r['seq_len']}" for r in train_rows]
    names = [k for k in train_rows[0] if isinstance(train_rows[0][k], dict)]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        x = [j + (i - (len(names) - 1) / 2) * width for j in range(len(labels))]
        bars = a.bar(x, [r[name]["tokens_per_s"] / 1000 for r in train_rows], width, label=name)
        for bar, r in zip(bars, train_rows):
            a.annotate(f"{r[name]['peak_memory_gib']:.0f} GiB", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                       ha="center", va="bottom", fontsize=7)
    a.set_xticks(range(len(labels)), labels)
    a.set(xlabel="micro-batch (sequences x tokens)", ylabel="k tokens/s",
          title=f"LoRA r={LORA.rank} training, Qwen2.5-0.5B shape (label: peak memory)")
    a.legend()
    if gap_samples:
        b = axes[0][1]
        for label, gaps in gap_samples.items():
            t = torch.tensor(sorted(gaps)) * 1000
            b.plot(t, torch.linspace(0, 1, len(t)), label=label)
        b.set(xscale="log", xlabel="inter-token latency (ms)", ylabel="CDF",
              title=f"{s['streams']} decode streams, with and without a training job")
        b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def versions(args) -> dict:
    import transformers

    found = {"transformers": transformers.__version__}
    if args.peers == "peft":
        import peft
        found["peft"] = peft.__version__
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--peers", choices=["peft", "none"], default="peft",
                        help="transformers + PEFT beside ours (SDPA; flash-attn 2 too where it imports)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables of our training steps")
    parser.add_argument("--plain-loss", action="store_true",
                        help="also ours with the plain loss over whole logits (what the chunked loss saves)")
    parser.add_argument("--window", type=float, help="serving window per condition, seconds (default 10; CPU 1)")
    parser.add_argument("--no-serving", action="store_true", help="training only")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    s = setup(args.device)
    if args.window is not None:
        s["window"] = args.window
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(0)
    torch.manual_seed(0)
    sides = {name: "ran" for name in systems(args)}
    if args.peers == "peft" and "peft_flash_attn_2" not in sides:
        sides["peft_flash_attn_2"] = "skipped: `import flash_attn` fails here" if args.device == "cuda" else \
            "skipped: CUDA only"
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "versions": versions(args),
        "model": s["config"], "lora": {"rank": LORA.rank, "alpha": LORA.alpha, "targets": list(LORA.targets)},
        "optimizer": {"name": "AdamW (fused on CUDA)", "lr": TRAIN.learning_rate, "betas": [0.9, 0.999],
                      "weight_decay": TRAIN.weight_decay, "max_grad_norm": TRAIN.max_grad_norm},
        "steps": {"warmup": s["warmup"], "timed": s["timed"], "runs_per_side": 2}, "sides": sides,
        "definitions": {
            "tokens_per_s": "every token of the timed steps' sequences (micro_batch x seq_len per step, targets or "
                            "not) over their wall time after the warm-up steps; the faster of two runs",
            "flops_per_token": "4 N (forward + input-gradient backward through the frozen weights; N = all 7 "
                               "projections of every layer + the LM head, no biases or norms) + 6 r (in + out) per "
                               "adapted projection + 7 S d h per layer (causal attention, forward 2 S^2 d h per "
                               "sequence, backward 2.5x)",
            "mfu": f"flops_per_token x tokens_per_s / {PEAK_TFLOPS:.0f} TFLOP/s (H100 SXM bf16 dense)",
            "peak_memory_gib": "torch.cuda.max_memory_allocated over a run from a fresh load, nothing else on the "
                               "GPU; the larger of the two runs",
            "ours_plain_loss": "our trainer with F.cross_entropy over the whole [tokens, vocab] logits, the loss "
                               "before service/finetune/loss.py",
            "peft": "AutoModelForCausalLM.from_pretrained(dtype=bf16, attn_implementation=...), LoraConfig(r, "
                    "lora_alpha, lora_dropout=0, all 7 projections), adapters float32, forward under "
                    "torch.autocast(bf16) as transformers' Trainer with bf16=True; its own loss (labels=input_ids)"},
        "streams": s["streams"], "prompt_tokens": s["prompt_tokens"], "new_tokens": s["new_tokens"],
        "window_s": s["window"]}
    started = time.time()

    def save(**parts):  # after each part: a later part that fails leaves the earlier ones written
        result.update(parts, elapsed_s=time.time() - started)
        (out / "finetune.json").write_text(json.dumps(result, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "qwen2.5-0.5b-random", s["config"], s["dtype"], args.device)
        save(training=bench_training(model_dir, args, s))
        if args.profile:
            save(profile=profile_training(model_dir, args, s, result["training"]))
        gaps = {}
        if not args.no_serving:
            serve_rows, gaps = asyncio.run(bench_serving(model_dir, Path(tmp) / "finetune", args.device, s))
            save(serving=serve_rows)
            print(f"\n{'condition':<22} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'decode tok/s':>12} "
                  f"{'train tok/s':>11}")
            for r in serve_rows:
                print(f"{r['condition']:<22} {r['p50_ms']:>7.2f} {r['p90_ms']:>7.2f} {r['p99_ms']:>7.2f} "
                      f"{r['decode_tokens_per_s']:>12.0f} {r.get('training_tokens_per_s', 0):>11.0f}")
        if args.device == "cuda":
            plot(result["training"], gaps, s, out / "finetune.png")
    print(f"wrote {out / 'finetune.json'} ({result['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
