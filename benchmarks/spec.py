"""Speculative decoding (service/engine/speculative.py): what a verify step costs and what speculation earns.

1. verify_cost: one step of B decoding sequences (context ~`--context` tokens) scoring k = 2, 4, 8 draft tokens
   each (k + 1 query rows through the prefill path, its CUDA graphs when they hold the step), against a plain decode
   step (k = 0, a decode graph), at B = 1, 8, 32: median ms of `--reps` runs of the runner.
2. forced_acceptance: tokens/s of greedy generation whose drafts are the reference output itself, each draft token
   kept with probability `alpha` (else replaced, so verification rejects it there): the speedup as a function of the
   acceptance rate, k = 4, against no speculation, with the acceptance back-off (`speculative_min_acceptance`, its
   default) and without it (`no_backoff`): where the latter's speedup falls below 1 the back-off should recover it.
3. copy_heavy_vs_free: the n-gram proposer on the embedded (trained) model, prompts that repeat a fortune (the
   output copies it) against prompts that do not: tokens/s with and without speculation (and without the back-off),
   and the acceptance rate.

Sections 1 and 2 run the embedded model, or with `--random-qwen` random bf16 weights in Qwen2.5-0.5B's shape
(benchmarks/generate.py), where a step is bound by memory and speculation can pay. `--device cpu` is a smoke run
(tiny sizes, CI: tests/test_spec_benchmark.py); the numbers mean something on the GPU only.

python benchmarks/spec.py [--device cuda|cpu] [--random-qwen] [--sections verify_cost,...] [--out DIR]
"""
import argparse
import gc
import gzip
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from service.config import DEFAULT_MODEL_DIR, Settings  # noqa: E402
from service.engine.llm import LLM  # noqa: E402
from service.engine.scheduler import ScheduledBatch  # noqa: E402
from service.protocol import SamplingParams  # noqa: E402

DEFAULT_MIN_ACCEPTANCE = Settings.model_fields["speculative_min_acceptance"].default


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    """Frees the device memory of the engines let go, before the next one sizes its KV cache from what is free (an
    engine freezes the garbage collector's view of its objects: thaw it so that their cycles go too)."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def verify_cost(model: str | None, device: str, batches: list[int], ks: list[int], context: int, reps: int) -> list:
    """Median ms of a plain decode step (k = 0) and of verify steps, for each batch size."""
    rows = []
    for batch_size in batches:
        # Synchronous steps: the runner is driven by hand below, with every input token on the host.
        llm = LLM(model, device=device, max_num_seqs=max(batches), max_model_len=context + 64, async_scheduling=False)
        engine = llm.engine
        prompts = [[random.randrange(10, 4000) for _ in range(context)] for _ in range(batch_size)]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"b{i}", prompt, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.num_waiting:
            engine.step()
        seqs, bm = engine.scheduler.running, engine.scheduler.block_manager
        for seq in seqs:  # slots for the largest draft: every verify below writes only past the sequence
            bm.append(seq.request_id, seq.cache_keys, max(ks))
        row = {"batch": batch_size, "context": context}
        for k in [0] + ks:
            batch = ScheduledBatch()
            for i, seq in enumerate(seqs):
                batch.seqs.append(seq)
                batch.starts.append(seq.num_computed_tokens)
                batch.num_tokens.append(1 + k)
                batch.is_prefill.append(False)
                batch.block_tables.append(bm.tables[seq.request_id])
                if k:
                    batch.drafts[i] = [seq.token_ids[-1]] * k
            times = []
            with torch.inference_mode():
                for _ in range(reps + 2):
                    synchronize(device)
                    start = time.perf_counter()
                    engine.runner.run(batch, None)
                    synchronize(device)
                    times.append(time.perf_counter() - start)
            row[f"k{k}_ms"] = sorted(times[2:])[reps // 2] * 1e3
        row.update({f"k{k}_vs_decode": row[f"k{k}_ms"] / row["k0_ms"] for k in ks})
        rows.append(row)
        engine.close()
        del llm, engine, seqs, bm, batch
        free_memory()
        print(json.dumps(row), flush=True)
    return rows


class ForcedProposer:
    """Drafts the reference output's next tokens; each kept with probability alpha, the first one not kept replaced
    by a wrong token (verification rejects it, and nothing after it counts)."""

    def __init__(self, reference: dict[tuple, list[int]], alpha: float, seed: int = 0):
        self.reference, self.alpha, self.rng = reference, alpha, random.Random(seed)

    def propose(self, seqs, limits):
        drafts = []
        for seq, k in zip(seqs, limits):
            done = len(seq.token_ids) - seq.num_prompt_tokens
            truth = self.reference[tuple(seq.prompt_token_ids)][done:done + k]
            for j, token in enumerate(truth):
                if self.rng.random() >= self.alpha:
                    truth = truth[:j] + [(token + 1) % 4000 + 10]
                    break
            drafts.append(truth)
        return drafts


def generate(llm: LLM, prompts: list, params: SamplingParams) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], time.perf_counter() - start


def forced_acceptance(model: str | None, device: str, batches: list[int], alphas: list[float], new_tokens: int,
                      k: int) -> list:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for batch_size in batches:
        prompts = [[random.randrange(10, 4000) for _ in range(64)] for _ in range(batch_size)]
        # No prefix cache, here and below: one engine runs the same prompts again (each alpha, with and without the
        # back-off), and a later run must not prefill less than the first.
        plain = LLM(model, device=device, enable_prefix_caching=False)
        generate(plain, prompts[:1], params)  # warm-up
        reference, seconds = generate(plain, prompts, params)
        plain.engine.close()
        del plain
        free_memory()
        row = {"batch": batch_size, "k": k, "plain_tokens_per_s": batch_size * new_tokens / seconds}
        spec = LLM(model, device=device, speculative_method="ngram", num_speculative_tokens=k,
                   enable_prefix_caching=False)
        generate(spec, prompts[:1], params)
        by_prompt = {tuple(p): r for p, r in zip(prompts, reference)}

        def run(llm: LLM, alpha: float, min_acceptance: float) -> dict:
            """One generation of the batch at acceptance alpha; drafts: sequences verified, backoffs: pauses."""
            speculator = llm.engine.speculator
            speculator.proposer, speculator.min_acceptance = ForcedProposer(by_prompt, alpha), min_acceptance
            s = speculator.stats
            before = s.drafts, s.draft_tokens, s.accepted_tokens, s.backoffs
            tokens, seconds = generate(llm, prompts, params)
            drafts, drafted, accepted, backoffs = (
                now - then for now, then in zip((s.drafts, s.draft_tokens, s.accepted_tokens, s.backoffs), before))
            return {"tokens_per_s": batch_size * new_tokens / seconds, "acceptance": accepted / max(drafted, 1),
                    "speedup": batch_size * new_tokens / seconds / row["plain_tokens_per_s"],
                    "drafts": drafts, "backoffs": backoffs,
                    # exact in float32; bf16 verify and decode kernels may round a near tie apart
                    "identical_to_plain": tokens == reference}

        for alpha in alphas:
            row[f"alpha{alpha}"] = {**run(spec, alpha, DEFAULT_MIN_ACCEPTANCE), "no_backoff": run(spec, alpha, 0.0)}
        spec.engine.close()
        del spec
        free_memory()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def copy_heavy_vs_free(device: str, count: int, new_tokens: int, k: int) -> list:
    texts = gzip.decompress((DEFAULT_MODEL_DIR / "corpus.txt.gz").read_bytes()).decode().split("\n%\n")
    fortunes = [t for t in texts[100:2000] if 60 < len(t) < 160][:count]
    workloads = {"copy_heavy": [f + "\n%\n" + f + "\n%\n" + f[:20] for f in fortunes],
                 "free": [f[:40] for f in fortunes]}
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for name, prompts in workloads.items():
        row = {"workload": name, "prompts": len(prompts), "k": k}
        outputs = {}
        for method in (None, "ngram"):
            llm = LLM(None, device=device, speculative_method=method, num_speculative_tokens=k,
                      enable_prefix_caching=False)
            generate(llm, prompts[:1], params)
            outputs[method], seconds = generate(llm, prompts, params)
            row[f"{method or 'plain'}_tokens_per_s"] = len(prompts) * new_tokens / seconds
            if method:
                s = llm.engine.speculator.stats
                row["acceptance"] = s.accepted_tokens / max(s.draft_tokens, 1)
                row["mean_accepted_per_draft"] = s.accepted_tokens / max(s.drafts, 1)
                row["backoffs"] = s.backoffs
                llm.engine.speculator.min_acceptance = 0.0  # the same engine, warm, without the back-off
                _, seconds = generate(llm, prompts, params)
                row["ngram_no_backoff_tokens_per_s"] = len(prompts) * new_tokens / seconds
            llm.engine.close()
            del llm
            free_memory()
        row["identical_to_plain"] = outputs[None] == outputs["ngram"]
        row["speedup"] = row["ngram_tokens_per_s"] / row["plain_tokens_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--random-qwen", action="store_true", help="sections 1-2 on Qwen2.5-0.5B-shaped weights")
    parser.add_argument("--sections", default="verify_cost,forced_acceptance,copy_heavy_vs_free",
                        help="comma list of the sections to run (each starts engines of its own)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    random.seed(0)
    smoke = args.device == "cpu"
    tmp, model = None, None
    if args.random_qwen:
        from benchmarks.generate import write_checkpoint
        tmp = Path(tempfile.mkdtemp(prefix="bench-spec-"))
        write_checkpoint(tmp)
        model = str(tmp)
    sections = {
        "verify_cost": lambda: verify_cost(model, args.device, [1, 2] if smoke else [1, 8, 32],
                                           [2, 4] if smoke else [2, 4, 8], 32 if smoke else 1024, 2 if smoke else 50),
        "forced_acceptance": lambda: forced_acceptance(model, args.device, [1] if smoke else [1, 8, 32],
                                                       [0.0, 1.0] if smoke else [0.0, 0.5, 0.8, 1.0],
                                                       12 if smoke else 256, 4),
        "copy_heavy_vs_free": lambda: copy_heavy_vs_free(args.device, 2 if smoke else 32, 12 if smoke else 128, 4),
    }
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "model": "random Qwen2.5-0.5B shape" if model else "embedded default model"}
    try:
        for name in args.sections.split(","):
            result[name] = sections[name]()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'spec.json'}")


if __name__ == "__main__":
    main()
