"""Structured outputs: decode throughput of a batch whose every request is bound to a JSON schema (xgrammar
masks filled on the CPU while the GPU runs the step, applied in the sampler), beside the same batch unconstrained,
in one run, on the random bf16 Qwen2.5-0.5B-shaped checkpoint of benchmarks/generate.py (with the embedded
model's 4096-token tokenizer: the masks' CPU cost grows with a real 150k vocabulary's, their GPU cost does not).

Batch 64 (and 1), 128-token random prompts, up to 256 new tokens, sampled at temperature 1 (no seed: seeded rows
add a per-row draw to every step, constrained or not). Constrained
outputs that end (finish "stop") are parsed and checked against the schema with `jsonschema` when installed.

python benchmarks/structured.py [--out DIR]
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
from benchmarks.bar_chart import grouped_bars  # noqa: E402
from benchmarks.generate import CONFIG, PROMPT_LEN, write_checkpoint  # noqa: E402
from service.engine.llm import LLM  # noqa: E402
from service.protocol import Grammar, SamplingParams  # noqa: E402

NEW_TOKENS = 256
ORDER = {"type": "object", "required": ["id", "status", "customer", "items"], "properties": {
    "id": {"type": "integer", "minimum": 1},
    "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
    "customer": {"type": "object", "required": ["name", "email"], "properties": {
        "name": {"type": "string"}, "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}}},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["sku", "qty"], "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1,
                                                                          "maximum": 99},
        "note": {"type": "string"}}}}}}


class Timers:
    """Host seconds spent in the engine's parts (wrapped methods), to tell where a constrained step's time goes."""

    def __init__(self, engine):
        self.seconds: dict[str, float] = {}
        for owner, name in ((engine.grammars, "fill_masks"), (engine, "_complete"), (engine, "sampler"),
                            (engine.runner, "run"), (engine.scheduler, "schedule")):
            setattr(owner, name, self._timed(name, getattr(owner, name)))

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return timed


def run(llm: LLM, prompts: list[list[int]], grammar: Grammar | None, timers: Timers | None = None) -> dict:
    engine = llm.engine
    if timers is not None:
        timers.seconds.clear()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0,
                                                           ignore_eos=grammar is None, grammar=grammar))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    reasons = {}
    full_steps = []
    start = time.perf_counter()
    while engine.has_work:
        outputs, stats = engine.step()
        for out in outputs:
            tokens[out.request_id].append(out.token_id)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        if stats is not None and stats.num_prefill_tokens == 0 and stats.batch_size == len(prompts):
            full_steps.append(stats.step_seconds)
    elapsed = time.perf_counter() - start
    generated = sum(map(len, tokens.values()))
    valid = checked = 0
    if grammar is not None:
        try:
            import jsonschema
        except ImportError:
            jsonschema = None
        for rid, ids in tokens.items():
            if reasons[rid] in ("stop", "eos_token") and jsonschema is not None:
                checked += 1
                text = llm.tokenizer.decode(ids, skip_special_tokens=True)
                try:
                    jsonschema.validate(json.loads(text), ORDER)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    print(f"  invalid output {rid}: {text[:120]!r}")
    full_steps.sort()
    host = {k: round(1e3 * v / max(1, len(full_steps)), 3) for k, v in (timers.seconds if timers else {}).items()}
    return {"host_ms_per_step": host,"tok_per_s": generated / elapsed, "tokens": generated, "seconds": elapsed,
            "full_batch_step_median_ms": 1e3 * full_steps[len(full_steps) // 2] if full_steps else None,
            "finished_by_grammar": sum(r in ("stop", "eos_token") for r in reasons.values()),
            "validated": valid, "checked": checked}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--profile", action="store_true", help="time the engine's host parts per step")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    write_checkpoint(tmp)
    llm = LLM(str(tmp), dtype="bfloat16", max_num_seqs=256, gpu_memory_utilization=0.6, max_model_len=4096)
    g = torch.Generator().manual_seed(0)
    grammar = Grammar("json", json.dumps(ORDER))
    llm.engine.grammars.compile(grammar).result()  # compiled once, as a server's cache would hold it
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "commit": os.environ.get("BENCH_COMMIT"), "rows": [],
               "config": "Qwen2.5-0.5B-shaped, random bf16, embedded 4096-token tokenizer"}
    prompt = lambda: torch.randint(0, CONFIG["vocab_size"], (PROMPT_LEN,), generator=g).tolist()  # noqa: E731
    timers = Timers(llm.engine) if args.profile else None
    run(llm, [prompt() for _ in range(8)], grammar)  # warm-up: kernels, xgrammar's threads
    print(f"{'batch':>5} {'mode':>12} {'tok/s':>9} {'step ms':>8} {'tokens':>7} {'ended':>6} {'valid':>6}")
    for batch in (1, 64):
        for mode, g_ in (("free", None), ("json_schema", grammar)):
            r = run(llm, [prompt() for _ in range(batch)], g_, timers)
            results["rows"].append({"batch": batch, "mode": mode, **r})
            step = r["full_batch_step_median_ms"]
            print(f"{batch:5d} {mode:>12} {r['tok_per_s']:9.0f} {step or 0:8.2f} {r['tokens']:7d} "
                  f"{r['finished_by_grammar']:6d} {r['validated']:3d}/{r['checked']}  {r['host_ms_per_step'] or ''}")
        free, bound = results["rows"][-2], results["rows"][-1]
        ratio = bound["tok_per_s"] / free["tok_per_s"]
        results[f"ratio_batch{batch}"] = ratio
        print(f"batch {batch}: constrained / free tok/s = {ratio:.2f}")
    (out / "structured.json").write_text(json.dumps(results, indent=2))
    labels = [f"batch {b}" for b in (1, 64)]
    series = {mode: [r["tok_per_s"] for r in results["rows"] if r["mode"] == mode] for mode in ("free", "json_schema")}
    grouped_bars(out / "structured.png", labels, series, "tok/s",
                 f"Decode with every request bound to a JSON schema ({results['gpu']})", figsize=(7, 4))


if __name__ == "__main__":
    main()
