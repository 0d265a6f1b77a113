"""Speculative decoding (service/engine/speculative.py): what a verify step costs and what speculation earns.

1. verify_cost: one step of B decoding sequences (context ~`--context` tokens) scoring k = 2, 4, 8 draft tokens
   each (k + 1 decode rows, the decode graph of their count), against a plain decode step (k = 0, a decode
   graph), at B = 1, 8, 32: median ms of `--reps` runs of the runner.
2. forced_acceptance: tokens/s of greedy generation whose verification is forced to acceptance `alpha`
   (ForcedAcceptance): the speedup as a function of the acceptance rate, k = 4, against no
   speculation, with the acceptance back-off (`speculative_min_acceptance`, its default) and without it
   (`no_backoff`): where the latter's speedup falls below 1 the back-off should recover it.
3. copy_heavy_vs_free: the n-gram proposer on trained text: the embedded model's copying variant
   (benchmarks/copying_model: the default model learned no copying), prompts that repeat a fortune (the answer
   copies its rest, then ends) against prompts that do not, all at once and one at a time (a single stream):
   tokens/s with and without speculation (and without the back-off), and the acceptance rate.

4. many_streams: what speculation on costs at 128 streams of random prompts, where it cannot pay: tokens/s with
   the n-gram proposer (speculative_disable_by_batch_size unset, 64, 32, 16) against speculation off, all in one
   engine, taking turns over 5 rounds (medians).

5. draft_model: single-stream tokens/s of greedy generation with a draft model (service/engine/draft_model.py),
   k = 4, against no speculation: the target as its own draft (every draft accepted: the machinery's best case, a
   second model's steps paid in full) and a draft of the target's first layers. On CUDA the target has random bf16
   weights in Qwen2.5-0.5B's shape (the one of `--random-qwen`): random weights cannot show a real draft's
   acceptance (its first layers' guesses are rarely the whole model's), only what drafting costs at either end.

6. ngram_host_cost: the host's time per step for one sequence's n-gram proposal at 500 to 8,000 tokens of
   context: the proposer's index against a scan of the context (the method before it).

7. backoff_policy (host only, seconds): the acceptance back-off as shipped against none, one stream, forced
   acceptance constant or changing (a request that stops or starts copying), each step costing what section 2's
   batch-1 row measured in this run (else H100_STEP_MS): predicted tokens/s over plain decoding. It chose the
   back-off's constants; section 2 measures them.

Sections 1, 2 and 4 run the embedded model, or with `--random-qwen` random bf16 weights in Qwen2.5-0.5B's shape
(benchmarks/generate.py), where a step is bound by memory and speculation can pay. `--device cpu` is a smoke run
(tiny sizes, the embedded model everywhere, CI: tests/test_spec_benchmark.py); the numbers mean something on the
GPU only, but for section 6's, which time the host.

python benchmarks/spec.py [--device cuda|cpu] [--random-qwen] [--sections verify_cost,...] [--out DIR]
"""
import argparse
import gc
import gzip
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.provenance import git_commit  # noqa: E402
from benchmarks.timing import synchronize  # noqa: E402
from service.config import DEFAULT_MODEL_DIR, Settings  # noqa: E402
from service.engine import speculative  # noqa: E402
from service.engine.llm import LLM  # noqa: E402
from service.engine.scheduler import ScheduledBatch  # noqa: E402
from service.engine.sequence import Sequence, Status  # noqa: E402
from service.protocol import SamplingParams  # noqa: E402

COPYING_MODEL_DIR = Path(__file__).resolve().parent / "copying_model"
DEFAULT_MIN_ACCEPTANCE = Settings.model_fields["speculative_min_acceptance"].default


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


def keep_probability(alpha: float, n: int) -> float:
    """p such that keeping each of n draft tokens with probability p, up to the first one not kept, keeps alpha n
    of them on average ((p + p^2 + .. + p^n) / n = alpha), by bisection (the mean grows with p)."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(1, n + 1)) / n < alpha else (lo, mid)
    return hi if alpha >= 1 else lo


def kept_tokens(rng: random.Random, p: float, n: int) -> int:
    kept = 0
    while kept < n and rng.random() < p:
        kept += 1
    return kept


class ForcedAcceptance:
    """A proposer and a greedy verification forced to acceptance alpha (accepted / drafted tokens, as the engine
    counts it): drafts k arbitrary tokens, and in place of speculative.accept_greedy keeps each with the probability
    keep_probability(alpha, k), up to the first one not kept, then takes the target's token there. The steps are
    those of a proposer at acceptance alpha whatever the weights (with random ones no proposer agrees with the
    target, and bf16 verify and decode kernels round near ties apart, so drafts taken from a reference output stop
    matching soon); the tokens generated are not the model's: times only."""

    def __init__(self, alpha: float, seed: int = 0):
        self.alpha, self.rng, self.keep = alpha, random.Random(seed), {}

    def propose(self, seqs, limits):
        return [[seq.token_ids[-1]] * k for seq, k in zip(seqs, limits)]

    def accept(self, draft: list[int], targets: list[int]) -> list[int]:
        n = len(draft)
        if n not in self.keep:
            self.keep[n] = keep_probability(self.alpha, n)
        kept = kept_tokens(self.rng, self.keep[n], n)
        return draft[:kept] + [targets[kept]]


# Step costs of the backoff_policy section when the run has no forced_acceptance rows of its own: one stream on
# the H100 at 35dff4c, ms (a plain decode step, overlapped; a speculative step of k = 4, proposal to verify).
H100_STEP_MS = (0.84, 1.38)
# Workloads of the backoff_policy section besides constant acceptance: (acceptance, tokens) phases of one stream.
CHANGING = {"alternating 0 / 0.8 by 128": [(0.0, 128), (0.8, 128)] * 4, "stops copying": [(0.8, 200), (0.0, 800)],
            "starts copying": [(0.0, 300), (0.8, 700)]}
# The back-off's constants before 2026-11-28 (EMA weight, threshold, first and longest pause), compared beside.
PREVIOUS_BACKOFF = (0.5, 0.1, 8, 128)


def backoff_policy(step_ms: tuple[float, float], alphas: list[float], new_tokens: int, k: int, runs: int) -> dict:
    """Section 7, host only: the acceptance back-off as shipped (the engine's Speculator, with its defaults),
    with PREVIOUS_BACKOFF's constants, and none, for one stream under forced acceptance (constant, and changing as
    CHANGING's), with a plain step and a speculative step costing step_ms: the predicted tokens/s over plain
    decoding, the mean of `runs` seeded runs. A step paused by the back-off costs a plain step (it overlaps)."""
    plain_ms, spec_ms = step_ms
    shipped = (speculative.EMA_WEIGHT, DEFAULT_MIN_ACCEPTANCE, speculative.BACKOFF_MIN, speculative.BACKOFF_MAX)

    def speedup(phases: list[tuple[float, int]], constants: tuple, seed: int) -> float:
        ema_weight, min_acceptance, first, longest = constants
        with mock.patch.multiple(speculative, EMA_WEIGHT=ema_weight, BACKOFF_MIN=first, BACKOFF_MAX=longest):
            return one_stream(phases, min_acceptance, random.Random(seed))

    def one_stream(phases: list[tuple[float, int]], min_acceptance: float, rng: random.Random) -> float:
        total = sum(n for _, n in phases)
        keep = [p for alpha, n in phases for p in [keep_probability(alpha, k)] * n]
        speculator = speculative.Speculator(ForcedAcceptance(0.0), k, None, total + 2, min_acceptance)
        seq = Sequence("policy", [0], SamplingParams(max_new_tokens=total, temperature=0.0, ignore_eos=True))
        seq.status, ms = Status.RUNNING, 0.0
        while (done := len(seq.token_ids) - 1) < total:
            seq.num_computed_tokens = done
            speculator.propose([seq])
            kept = 0
            if seq.draft:
                kept = kept_tokens(rng, keep[done], len(seq.draft))
                speculator.record(seq, len(seq.draft), kept)
            seq.token_ids += [0] * (kept + 1)  # the kept drafts and the target's token
            ms += spec_ms if seq.draft else plain_ms
        return total * plain_ms / ms

    workloads = {f"acceptance {alpha}": [(alpha, new_tokens)] for alpha in alphas} | CHANGING
    sides = {"shipped": shipped, "previous": PREVIOUS_BACKOFF, "no_backoff": (shipped[0], 0.0, *shipped[2:])}
    rows = []
    for name, phases in workloads.items():
        means = {side: statistics.mean(speedup(phases, constants, seed) for seed in range(runs))
                 for side, constants in sides.items()}
        rows.append({"workload": name, **means})
        print(json.dumps(rows[-1]), flush=True)
    keys = ("ema_weight", "min_acceptance", "first_pause", "longest_pause")
    return {"step_ms": {"plain": plain_ms, "speculative": spec_ms}, "k": k, "runs": runs,
            **{f"{side}_constants": dict(zip(keys, c)) for side, c in sides.items() if side != "no_backoff"},
            "rows": rows}


def forced_step_ms(rows: list) -> tuple[float, float] | None:
    """(plain, speculative) step ms of one stream from forced_acceptance's batch-1 row: its plain tokens/s, and
    speculation at acceptance 0 without the back-off, where every step verifies a draft and keeps one token."""
    row = next((r for r in rows if r["batch"] == 1 and "alpha0.0" in r), None)
    if row is None:
        return None
    return 1e3 / row["plain_tokens_per_s"], 1e3 / row["alpha0.0"]["no_backoff"]["tokens_per_s"]


def spec_totals(llm: LLM) -> tuple[int, int, int, int]:
    """The engine's speculation counters: sequences verified, draft tokens, accepted ones, back-off pauses."""
    s = llm.engine.speculator.stats
    return s.drafts, s.draft_tokens, s.accepted_tokens, s.backoffs


def generate(llm: LLM, prompts: list, params: SamplingParams) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], time.perf_counter() - start


def forced_acceptance(model: str | None, device: str, batches: list[int], alphas: list[float], new_tokens: int,
                      k: int, repeats: int) -> list:
    """Each cell: the median tokens/s of `repeats` generations of the batch (a batch-1 run is a tenth of a second:
    one run alone varied by 8%), drafts and pauses summed over them."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for batch_size in batches:
        prompts = [[random.randrange(10, 4000) for _ in range(64)] for _ in range(batch_size)]
        # No prefix cache, here and below: one engine runs the same prompts again (each alpha, with and without the
        # back-off), and a later run must not prefill less than the first.
        plain = LLM(model, device=device, enable_prefix_caching=False)
        generate(plain, prompts[:1], params)  # warm-up
        seconds = statistics.median(generate(plain, prompts, params)[1] for _ in range(repeats))
        plain.engine.close()
        del plain
        free_memory()
        row = {"batch": batch_size, "k": k, "plain_tokens_per_s": batch_size * new_tokens / seconds}
        spec = LLM(model, device=device, speculative_method="ngram", num_speculative_tokens=k,
                   enable_prefix_caching=False)
        generate(spec, prompts[:1], params)

        def run(llm: LLM, alpha: float, min_acceptance: float) -> dict:
            """One generation of the batch at acceptance alpha; drafts: sequences verified, backoffs: pauses."""
            speculator, forced = llm.engine.speculator, ForcedAcceptance(alpha)
            speculator.proposer, speculator.min_acceptance = forced, min_acceptance
            before = spec_totals(llm)
            greedy, speculative.accept_greedy = speculative.accept_greedy, forced.accept
            try:
                seconds = statistics.median(generate(llm, prompts, params)[1] for _ in range(repeats))
            finally:
                speculative.accept_greedy = greedy
            drafts, drafted, accepted, backoffs = (now - then for now, then in zip(spec_totals(llm), before))
            return {"tokens_per_s": batch_size * new_tokens / seconds, "acceptance": accepted / max(drafted, 1),
                    "speedup": batch_size * new_tokens / seconds / row["plain_tokens_per_s"],
                    "drafts": drafts, "backoffs": backoffs}

        for alpha in alphas:
            row[f"alpha{alpha}"] = {**run(spec, alpha, DEFAULT_MIN_ACCEPTANCE), "no_backoff": run(spec, alpha, 0.0)}
        spec.engine.close()
        del spec
        free_memory()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def copy_heavy_vs_free(device: str, count: int, new_tokens: int, k: int) -> list:
    """The n-gram proposer on the embedded model's copying variant (COPYING_MODEL_DIR): `count` prompts at once, and
    the same prompts one at a time (a single stream), of each workload. copy_heavy: a fortune said twice, then its
    first words (cut at a space, as an answer's tokens would start: a cut inside a word tokenizes unlike the
    passage, and the model no longer finds it); the answer says the rest of the fortune and ends (its EOS is
    honoured: past it a greedy model writes whatever, and that was most of the 128 tokens when the workload ignored
    EOS). free: a fortune's first words, which the model continues on its own. tokens/s counts the tokens
    generated."""
    texts = gzip.decompress((DEFAULT_MODEL_DIR / "corpus.txt.gz").read_bytes()).decode().split("\n%\n")
    fortunes = [t for t in texts[100:2000] if 60 < len(t) < 160 and " " in t[20:40]][:count]
    starts = [f[:f.index(" ", 20)] for f in fortunes]
    workloads = {"copy_heavy": [f + "\n%\n" + f + "\n%\n" + start for f, start in zip(fortunes, starts)],
                 "free": starts}
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    rows = []
    for name, prompts in workloads.items():
        for streams in (len(prompts), 1):
            todo = [prompts] if streams > 1 else [[p] for p in prompts]  # one at a time: each its own call
            row = {"workload": name, "streams": streams, "prompts": len(prompts), "k": k}
            outputs = {}
            for method in (None, "ngram"):
                llm = LLM(str(COPYING_MODEL_DIR), device=device, speculative_method=method,
                          num_speculative_tokens=k, enable_prefix_caching=False)
                generate(llm, prompts[:1], params)
                outputs[method], seconds = run_all(llm, todo, params)
                tokens = sum(map(len, outputs[method]))
                row[f"{method or 'plain'}_tokens_per_s"] = tokens / seconds
                if method:
                    s = llm.engine.speculator.stats
                    row["acceptance"] = s.accepted_tokens / max(s.draft_tokens, 1)
                    row["mean_accepted_per_draft"] = s.accepted_tokens / max(s.drafts, 1)
                    row["backoffs"] = s.backoffs
                    llm.engine.speculator.min_acceptance = 0.0  # the same engine, warm, without the back-off
                    _, seconds = run_all(llm, todo, params)
                    row["ngram_no_backoff_tokens_per_s"] = tokens / seconds
                else:
                    row["tokens"] = tokens
                llm.engine.close()
                del llm
                free_memory()
            row["identical_to_plain"] = outputs[None] == outputs["ngram"]
            row["speedup"] = row["ngram_tokens_per_s"] / row["plain_tokens_per_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def run_all(llm: LLM, groups: list[list], params: SamplingParams) -> tuple[list[list[int]], float]:
    """Each group of prompts generated together, one group after the other: the outputs and the seconds in all."""
    outputs, seconds = [], 0.0
    for prompts in groups:
        out, s = generate(llm, prompts, params)
        outputs += out
        seconds += s
    return outputs, seconds


def many_streams(model: str | None, device: str, streams: int, new_tokens: int, thresholds: list[int | None],
                 rounds: int) -> dict:
    """What speculation on costs where it cannot pay: `streams` greedy requests of random prompts (few n-gram
    matches) at once, tokens/s with the n-gram proposer at each `speculative_disable_by_batch_size` of `thresholds`,
    against speculation off (async scheduling as the engine defaults it). One engine, built with the proposer, runs
    every configuration in turn, `rounds` times, each round in another order: off with its speculator taken away
    (what an engine without `speculative_method` has: the runner and the scheduler do not depend on it), the others
    with the limit set. Each configuration's tok/s is its median over the rounds, vs_off against off's. (An engine
    of its own per configuration, one after another in one process, read 61-91k tok/s at 128 streams on an H200
    for configurations that all decoded without a draft, c11b327: a spread no 3% could be read through.)"""
    prompts = [[random.randrange(10, 4000) for _ in range(64)] for _ in range(streams)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    llm = LLM(model, device=device, enable_prefix_caching=False, speculative_method="ngram")
    speculator = llm.engine.speculator
    generate(llm, prompts, warm)  # the timed runs compile nothing
    limits = {"off": None} | {f"ngram_disable_at_{t}": t for t in thresholds}
    names = list(limits)
    rates, drafts = {name: [] for name in names}, dict.fromkeys(names, 0)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            llm.engine.speculator = None if name == "off" else speculator
            speculator.disable_by_batch_size = limits[name]
            before = speculator.stats.drafts
            _, seconds = generate(llm, prompts, params)
            rates[name].append(streams * new_tokens / seconds)
            drafts[name] += speculator.stats.drafts - before
    llm.engine.speculator = speculator
    llm.engine.close()
    del llm
    free_memory()
    row = {"streams": streams, "new_tokens": new_tokens, "rounds": rounds}
    for name in names:
        row[name] = {"tokens_per_s": statistics.median(rates[name]), "runs": rates[name]}
        if name != "off":
            row[name] |= {"drafts": drafts[name], "vs_off": row[name]["tokens_per_s"] / row["off"]["tokens_per_s"]}
    print(json.dumps(row), flush=True)
    return row


def ngram_host_cost(contexts: list[int], steps: int) -> list:
    """The host's time for one sequence's n-gram proposal per step (3 new tokens a step, random tokens: few
    matches, the longest search): the proposer's index (NgramIndex, built once, then grown) against a numpy scan of
    the whole context each step (how proposals were found before the index), microseconds."""
    import numpy as np

    from service.engine.speculative import NgramIndex

    def scan(ids: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
        tokens = np.asarray(ids, dtype=np.int64)
        for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                return ids[hits[-1] + n:hits[-1] + n + k]
        return []

    rows = []
    for context in contexts:
        tokens = [random.randrange(10, 32000) for _ in range(context)]
        index = NgramIndex(2, 4)
        start = time.perf_counter()
        index.update(tokens)
        row = {"context": context, "index_build_us": 1e6 * (time.perf_counter() - start)}
        for name, propose in (("index", lambda: (index.update(tokens), index.lookup(tokens, 4))),
                              ("scan", lambda: scan(tokens, 4))):
            start = time.perf_counter()
            for _ in range(steps):
                tokens += [random.randrange(10, 32000) for _ in range(3)]
                propose()
            row[f"{name}_us_per_step"] = 1e6 * (time.perf_counter() - start) / steps
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def fewer_layers(src: Path, dst: Path, layers: int) -> Path:
    """A checkpoint of src's first `layers` layers, with its embeddings, final norm and head: a draft of the same
    vocabulary and shape, cheaper per token."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers:
                    tensors[name] = f.get_tensor(name)
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def draft_model(target: Path, random_weights: bool, device: str, new_tokens: int, k: int, draft_layers: int) -> dict:
    """Tokens/s of one greedy stream without speculation, with the target as its own draft, and with its first
    `draft_layers` layers as the draft; acceptance and whether the tokens are plain decoding's."""
    prompt = [random.randrange(10, 4000) for _ in range(128)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-draft-"))
    target_layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    result = {"k": k, "new_tokens": new_tokens, "target_layers": target_layers, "draft_layers": draft_layers,
              "note": "random weights (Qwen2.5-0.5B's shape) cannot show a real draft's acceptance: fewer_layers "
                      "shows what drafting costs when little is accepted, same_checkpoint (every draft accepted) "
                      "the machinery's best case" if random_weights else
                      "the embedded model, a smoke run: its steps are bound by the host, not by reading weights"}
    try:
        drafts = {"plain": None, "same_checkpoint": target,
                  "fewer_layers": fewer_layers(target, tmp / "draft", draft_layers)}
        for name, draft in drafts.items():
            spec = dict(speculative_method="draft_model", speculative_model=str(draft),
                        num_speculative_tokens=k) if draft else {}
            # No prefix cache: the timed run repeats the warm-up's prompt, and must prefill it all again.
            llm = LLM(str(target), device=device, enable_prefix_caching=False, **spec)
            generate(llm, [prompt], params)  # warm-up
            before = spec_totals(llm) if draft else None
            (tokens,), seconds = generate(llm, [prompt], params)
            row = {"tokens_per_s": new_tokens / seconds}
            if draft is None:
                reference = tokens
            else:
                verified, drafted, accepted, backoffs = (now - then for now, then in zip(spec_totals(llm), before))
                row |= {"speedup": row["tokens_per_s"] / result["plain"]["tokens_per_s"],
                        "acceptance": accepted / max(drafted, 1), "drafts": verified,
                        "mean_accepted_per_draft": accepted / max(verified, 1), "backoffs": backoffs,
                        # exact in float32; bf16 verify and decode kernels may round a near tie apart
                        "identical_to_plain": tokens == reference}
            result[name] = row
            llm.engine.close()
            del llm
            free_memory()
            print(json.dumps({name: row}), flush=True)
    finally:
        shutil.rmtree(tmp)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--random-qwen", action="store_true", help="sections 1-2 on Qwen2.5-0.5B-shaped weights")
    parser.add_argument("--sections",
                        default="verify_cost,forced_acceptance,copy_heavy_vs_free,many_streams,draft_model,"
                                "ngram_host_cost,backoff_policy",
                        help="comma list of the sections to run (each starts engines of its own)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--policy-runs", type=int, help="seeded runs per backoff_policy cell (3 on cpu, else 30)")
    args = parser.parse_args()
    random.seed(0)
    smoke = args.device == "cpu"
    tmp, model = None, None
    names = args.sections.split(",")
    # The draft-model section times the random Qwen shape on CUDA, with or without --random-qwen.
    if args.random_qwen or not smoke and "draft_model" in names:
        from benchmarks.generate import write_checkpoint
        tmp = Path(tempfile.mkdtemp(prefix="bench-spec-"))
        write_checkpoint(tmp)
    if args.random_qwen:
        model = str(tmp)
    sections = {
        "verify_cost": lambda: verify_cost(model, args.device, [1, 2] if smoke else [1, 8, 32],
                                           [2, 4] if smoke else [2, 4, 8], 32 if smoke else 1024, 2 if smoke else 50),
        "forced_acceptance": lambda: forced_acceptance(model, args.device, [1] if smoke else [1, 8, 32],
                                                       [0.0, 1.0] if smoke else [0.0, 0.5, 0.8, 1.0],
                                                       12 if smoke else 256, 4, 1 if smoke else 3),
        "copy_heavy_vs_free": lambda: copy_heavy_vs_free(args.device, 2 if smoke else 32, 12 if smoke else 128, 4),
        "many_streams": lambda: many_streams(model, args.device, 4 if smoke else 128, 8 if smoke else 128,
                                             [None, 2] if smoke else [None, 64, 32, 16], 2 if smoke else 5),
        "ngram_host_cost": lambda: ngram_host_cost([500, 2000] if smoke else [500, 2000, 8000], 20 if smoke else 200),
        "draft_model": lambda: draft_model(DEFAULT_MODEL_DIR if smoke else tmp, not smoke, args.device,
                                           12 if smoke else 256, 4, 2 if smoke else 4),
        "backoff_policy": lambda: backoff_policy(forced_step_ms(result.get("forced_acceptance", [])) or H100_STEP_MS,
                                                 [0.0, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0], 1024, 4,
                                                 args.policy_runs or (3 if smoke else 30)),
    }
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    models = {"copy_heavy_vs_free": "embedded model's copying variant (benchmarks/copying_model)",
              "ngram_host_cost": "none (host-side lookups)",
              "backoff_policy": "none (a model of the step costs)",
              "draft_model": "embedded default model" if smoke else "random Qwen2.5-0.5B shape"}
    result = {}
    try:
        for name in names:
            result[name] = sections[name]()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp)
    # The sections run now replace theirs in spec.json; the others stay, each with the run it came from.
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "spec.json"
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged.update(result)
    default_model = "random Qwen2.5-0.5B shape" if model else "embedded default model"
    merged.setdefault("runs", {}).update({name: {"device": device, "commit": git_commit(), "model": models.get(
        name, default_model), "date": time.strftime("%Y-%m-%d")} for name in names})
    path.write_text(json.dumps(merged, indent=2) + "\n")
    plot(merged, out / "spec.png")
    print(f"wrote {out / 'spec.json'} and spec.png")


def plot(result: dict, path: Path) -> None:
    """Three panels, those of the sections that ran: a verify step's time over a decode step's by draft length, one
    line per batch; speedup over plain decoding against the forced acceptance rate, one line per batch (dashed:
    without the back-off); the n-gram proposer's speedup by workload and streams."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (verify, forced, workloads) = plt.subplots(1, 3, figsize=(16, 4.5))
    for row in result.get("verify_cost", []):
        ks = sorted(int(key[1:-len("_vs_decode")]) for key in row if key.endswith("_vs_decode"))
        verify.plot(ks, [row[f"k{k}_vs_decode"] for k in ks], marker="o", label=f"batch {row['batch']}")
    verify.set(xlabel="draft tokens k", ylabel="verify step / decode step", title="Verify step cost")
    for row in result.get("forced_acceptance", []):
        alphas = sorted(float(key[5:]) for key in row if key.startswith("alpha"))
        line, = forced.plot(alphas, [row[f"alpha{a}"]["speedup"] for a in alphas], marker="o",
                            label=f"batch {row['batch']}")
        forced.plot(alphas, [row[f"alpha{a}"]["no_backoff"]["speedup"] for a in alphas], ls="--",
                    color=line.get_color())
    forced.axhline(1.0, color="gray", lw=0.8)
    forced_model = result.get("runs", {}).get("forced_acceptance", {}).get("model", "")
    forced.set(xlabel="acceptance (accepted / drafted)", ylabel="tokens/s over plain decoding",
               title=f"Forced acceptance, k = 4 ({forced_model})")
    rows = result.get("copy_heavy_vs_free", [])
    workloads.bar(range(len(rows)), [r["speedup"] for r in rows])
    workloads.set_xticks(range(len(rows)), [f"{r['workload']}\n{r['streams']} stream(s)" for r in rows])
    workloads.axhline(1.0, color="gray", lw=0.8)
    workloads.set(ylabel="tokens/s over plain decoding", title="n-gram proposals, embedded model")
    for ax in (verify, forced):
        if ax.get_legend_handles_labels()[0]:  # forced's unlabelled line at 1.0 is there without its section
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
