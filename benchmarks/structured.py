"""Structured outputs: decode throughput of a batch whose every request is bound to a JSON schema (xgrammar
masks filled on the CPU while the GPU runs the step, applied in the sampler), beside the same batch unconstrained,
in one run, on the random bf16 Qwen2.5-0.5B-shaped checkpoint of benchmarks/generate.py (with the embedded
model's 4096-token tokenizer: the masks' CPU cost grows with a real 150k vocabulary's, their GPU cost does not).

Batch 64 (and 1), 128-token random prompts, up to 256 new tokens, sampled at temperature 1 (no seed: seeded rows
add a per-row draw to every step, constrained or not). Constrained
outputs that end (finish "stop") are parsed and checked against the schema with `jsonschema` when installed.

--device cpu runs the same path on the embedded model (in float32; trained on fortunes, its JSON strings close
sooner than a random model's), the rows unseeded as on the GPU but torch's generator seeded once, so that every run
makes, and checks, the same outputs. --smoke runs decode at batch 1 and 4 after one warm-up request (on the CPU: the
smoke CI runs, about 20 s on 2 cores, some of its JSON outputs ending within the 256 tokens) and masks at fewer rows
and steps. The CPU's numbers only show that the path works. --profile works on both devices.

Section `masks` (host only, runs anywhere): the CPU time of one step's token masks (Grammars.fill_masks) for 1 to
64 grammar-bound rows, each at its own point of its output, with the rows shared among 1 or more threads
(service/engine/grammar.py's FILL_THREADS): the embedded 4096-token tokenizer under the schema above, and
benchmarks/serve.py's word-level vocabulary of 151,936 `w<digits>` words under a regex of its words (what the soak's
structured requests are on the GPU checkpoint). The step waits on these masks where they take longer than the
forward pass.

python benchmarks/structured.py [--out DIR] [--sections decode,masks] [--device cuda|cpu] [--smoke] [--profile]
python benchmarks/structured.py --device cpu --smoke  # CI's smokes, a section each (tests/test_structured_benchmark.py)
"""
import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bar_chart import grouped_bars  # noqa: E402
from benchmarks.generate import CONFIG, PROMPT_LEN, write_checkpoint  # noqa: E402
from benchmarks.provenance import git_commit  # noqa: E402
from benchmarks.serve import write_word_tokenizer  # noqa: E402
from service.config import DEFAULT_MODEL_DIR  # noqa: E402
from service.engine.grammar import FILL_THREADS, Grammars  # noqa: E402
from service.engine.llm import LLM  # noqa: E402
from service.protocol import Grammar, SamplingParams  # noqa: E402

NEW_TOKENS = 256
# The decode section's batches and warm-up requests: the GPU run's, and --smoke's (the module doc).
DECODE_SIZES = {"full": {"batches": (1, 64), "warmup": 8}, "smoke": {"batches": (1, 4), "warmup": 1}}
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
    steps = 0  # that ran a batch: the host parts' times are per step of the whole run
    start = time.perf_counter()
    while engine.has_work:
        outputs, stats = engine.step()
        steps += stats is not None
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
    host = {k: round(1e3 * v / max(1, steps), 3) for k, v in (timers.seconds if timers else {}).items()}
    return {"host_ms_per_step": host, "tok_per_s": generated / elapsed, "tokens": generated, "seconds": elapsed,
            "full_batch_step_median_ms": 1e3 * full_steps[len(full_steps) // 2] if full_steps else None,
            "finished_by_grammar": sum(r in ("stop", "eos_token") for r in reasons.values()),
            "validated": valid, "checked": checked}


def mask_times(rows_list: list[int], threads_list: list[int], steps: int) -> list[dict]:
    """Grammars.fill_masks' milliseconds per step (median over `steps`), per vocabulary case, rows and threads. Each
    row starts a few tokens into its output and takes a random allowed token (no stop) after every fill, the same
    ones whatever the threads (the masks are the same); a row the grammar ends starts over."""
    words_dir = Path(tempfile.mkdtemp(prefix="bench-structured-words-"))
    write_word_tokenizer(words_dir, CONFIG["vocab_size"], CONFIG["eos_token_id"])
    cases = {"embedded 4096, JSON schema": (DEFAULT_MODEL_DIR, 4096, 2, Grammar("json", json.dumps(ORDER))),
             "word-level 151936, regex": (words_dir, CONFIG["vocab_size"], CONFIG["eos_token_id"],
                                          Grammar("regex", "(w[0-9]{1,3}){1,64}"))}
    results = []
    for case, (model_dir, vocab, stop, grammar) in cases.items():
        for threads in threads_list:
            grammars = Grammars(model_dir, vocab, [stop], fill_threads=threads, pin_memory=torch.cuda.is_available())
            compiled = grammars.compile(grammar).result()
            json_rows = grammar.kind == "json"
            for rows in rows_list:
                rng = random.Random(rows)
                matchers = [grammars.matcher(compiled) for _ in range(rows)]
                times = []
                for step in range(steps + 8):  # 8 untimed steps: the rows spread over their outputs
                    start = time.perf_counter()
                    masks = grammars.fill_masks(matchers, list(range(rows)) if json_rows else [])
                    if step >= 8:
                        times.append(time.perf_counter() - start)
                    for row, matcher in enumerate(matchers):
                        bits = (masks[row].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
                        allowed = [t for t in bits.flatten()[:grammars.vocab_size].nonzero().flatten().tolist()
                                   if t != stop]
                        if not allowed or not matcher.accept_token(rng.choice(allowed)) or matcher.is_terminated():
                            matchers[row] = grammars.matcher(compiled)
                ms = 1e3 * statistics.median(times)
                results.append({"case": case, "rows": rows, "threads": threads, "ms_per_step": ms})
                print(f"{case:>28} {rows:5d} rows {threads:3d} threads {ms:8.3f} ms a step", flush=True)
            grammars.shutdown()
    shutil.rmtree(words_dir, ignore_errors=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--profile", action="store_true", help="time the engine's host parts per step")
    parser.add_argument("--sections", default="decode,masks", help="decode (on --device), masks (host only)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="decode's: cuda (the random Qwen2.5-0.5B-shaped checkpoint) or cpu (the embedded model)")
    parser.add_argument("--smoke", action="store_true",
                        help="masks: a few steps of few rows; decode: batch 1 and 4 (CI runs both on cpu)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "structured.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    sections = args.sections.split(",")
    if "masks" in sections:
        threads = sorted({1, 2, FILL_THREADS})
        rows = [1, 4] if args.smoke else [1, 8, 32, 64]
        results["masks"] = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                            "rows": mask_times(rows, threads, 3 if args.smoke else 50)}
        path.write_text(json.dumps(results, indent=2))
        cells = results["masks"]["rows"]
        label = lambda c: f"{c['case'].replace(', ', chr(10), 1)}, {c['rows']} rows"  # noqa: E731 (two lines)
        labels = list(dict.fromkeys(map(label, cells)))
        series = {f"{t} threads": [next(c["ms_per_step"] for c in cells if c["threads"] == t and label(c) == name)
                                   for name in labels] for t in threads}
        grouped_bars(out / "structured_masks.png", labels, series, "ms a step (log)",
                     f"Token masks of one step on the host ({os.cpu_count()} CPUs)", log=True, figsize=(16, 5))
    if "decode" in sections:
        decode(args, out, path, results)


def decode(args, out: Path, path: Path, results: dict) -> None:
    """Constrained against free decoding at batch 1 and 64 (--smoke: 1 and 4) (the module doc)."""
    size = DECODE_SIZES["smoke" if args.smoke else "full"]
    tmp = None
    if args.device == "cuda":
        tmp = Path(tempfile.mkdtemp(prefix="bench-structured-"))
        write_checkpoint(tmp)
        llm = LLM(str(tmp), dtype="bfloat16", max_num_seqs=256, gpu_memory_utilization=0.6, max_model_len=4096)
        device, config = torch.cuda.get_device_name(), "Qwen2.5-0.5B-shaped, random bf16, embedded 4096-token tokenizer"
    else:
        torch.manual_seed(0)  # the unseeded rows draw from it: the same outputs, and so the same checks, every run
        llm = LLM(None, device="cpu")
        device, config = "cpu", "the embedded model (6 layers, hidden 320, 4096-token tokenizer)"
    g = torch.Generator().manual_seed(0)
    grammar = Grammar("json", json.dumps(ORDER))
    llm.engine.grammars.compile(grammar).result()  # compiled once, as a server's cache would hold it
    results |= {"gpu": device, "torch": torch.__version__, "commit": git_commit(), "rows": [], "config": config}
    vocab = llm.engine.model.config.vocab_size
    prompt = lambda: torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist()  # noqa: E731
    timers = Timers(llm.engine) if args.profile else None
    run(llm, [prompt() for _ in range(size["warmup"])], grammar)  # warm-up: kernels, xgrammar's threads
    print(f"{'batch':>5} {'mode':>12} {'tok/s':>9} {'step ms':>8} {'tokens':>7} {'ended':>6} {'valid':>6}")
    for batch in size["batches"]:
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
    path.write_text(json.dumps(results, indent=2))  # with the masks section's, if it ran
    labels = [f"batch {b}" for b in size["batches"]]
    series = {mode: [r["tok_per_s"] for r in results["rows"] if r["mode"] == mode] for mode in ("free", "json_schema")}
    grouped_bars(out / "structured.png", labels, series, "tok/s",
                 f"Decode with every request bound to a JSON schema ({results['gpu']})", figsize=(7, 4))
    if tmp is not None:  # the random checkpoint, 1 GB
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
