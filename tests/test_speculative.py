"""Speculative decoding (n-gram proposals, service/engine/speculative.py) on the embedded model, CPU: greedy outputs
are the tokens plain decoding makes, through prefix-cache hits, chunked prefill, preemption and two tensor-parallel
ranks; rejected drafts leave no trace in the KV bookkeeping or the prefix cache; rejection sampling draws from the
target's distribution (a test that fails if the rejection step is skipped); what falls back to plain decoding; the
acceptance back-off (a sequence whose drafts keep failing stops proposing, and tries again later)."""
import gzip
import random
from collections import defaultdict

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from tiny_models import make_tiny_model

from kvcache import BlockManager
from service.config import DEFAULT_MODEL_DIR
from service.engine.llm import LLM
from service.engine.sequence import Sequence
from service.engine.speculative import NgramIndex, NgramProposer, Speculator, accept_greedy, accept_sampled
from service.metrics import EngineMetrics
from service.protocol import SamplingParams

GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """Copy-heavy prompts (a fortune twice, then its beginning), so that drafts are found and often accepted; every
    other one after a shared header of two full KV blocks, for prefix-cache hits."""
    texts = gzip.decompress((DEFAULT_MODEL_DIR / "corpus.txt.gz").read_bytes()).decode().split("\n%\n")
    fortunes = [t for t in texts[100:400] if 60 < len(t) < 140][:8]
    header = texts[50][:200] + "\n%\n"
    return [(header if i % 2 else "") + f + "\n%\n" + f + "\n%\n" + f[:20] for i, f in enumerate(fortunes)]


def make_llm(**settings) -> LLM:
    return LLM(None, device="cpu", dtype="float32", **settings)


def assert_no_leaks(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_work and not llm.engine.requests
    speculator = llm.engine.speculator
    assert speculator is None or not getattr(speculator.proposer, "indexes", None)  # n-gram indexes released


@pytest.fixture(scope="module")
def plain(prompts) -> list[list[int]]:
    llm = make_llm(enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("settings", [
    dict(max_num_batched_tokens=512),  # several prompts a step: prefix-cache hits on the shared header
    dict(num_kv_blocks=24),  # a tiny cache: preemption and recomputation
    dict(max_num_batched_tokens=32),  # chunked prefill, drafts cut to what the budget leaves
    dict(num_kv_blocks=40, max_num_batched_tokens=48, max_num_seqs=5),
], ids=["batched", "preempting", "chunked", "all-tight"])
def test_greedy_outputs_are_those_of_plain_decoding(prompts, plain, settings):
    llm = make_llm(**SPEC, **settings)
    stats, step = [], llm.engine.step

    def counting_step():
        outputs, s = step()
        stats.append((s, outputs))
        return outputs, s

    llm.engine.step = counting_step
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    spec = llm.engine.speculator.stats
    assert spec.drafts and 0 < spec.accepted_tokens <= spec.draft_tokens
    assert sum(spec.accepted_per_position) == spec.accepted_tokens
    # Streaming: a step reports a request's accepted tokens and the target's next one together.
    assert any(len({o.request_id for o in outputs}) < len(outputs) for _, outputs in stats)
    if "num_kv_blocks" in settings and settings["num_kv_blocks"] < 30:
        assert sum(s.num_preemptions for s, _ in stats if s)
    else:
        assert sum(s.prefix_hit_tokens for s, _ in stats if s)
    assert_no_leaks(llm)


def test_the_prefix_cache_holds_no_rejected_tokens(prompts, plain):
    """Blocks written by verify steps (accepted tokens beside rejected ones) and registered in the prefix cache
    serve later prompts: a continuation from them is the one a fresh engine computes."""
    llm = make_llm(**SPEC)
    first = llm.generate(prompts, GREEDY)
    again = [llm.tokenizer.encode(p) + o.token_ids for p, o in zip(prompts, first)]
    hits = llm.engine.scheduler.block_manager.prefix_hit_tokens
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    cached = llm.generate(again, params)
    assert llm.engine.scheduler.block_manager.prefix_hit_tokens - hits >= 16 * len(again)
    fresh = make_llm(enable_prefix_caching=False).generate(again, params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in fresh]
    assert_no_leaks(llm)


def test_two_ranks_verify_the_tokens_one_rank_makes(tmp_path):
    """TP 2 (gloo, one worker process) on a tiny random Llama (the embedded model's 5 heads do not split): verify
    steps are planned on rank 0 and run on both."""
    model = make_tiny_model("llama", tmp_path)
    prompts = [[5 + (7 * i + j) % 40 for j in range(24)] * 2 + [5 + 7 * i] for i in range(4)]

    def generate(**settings):
        llm = LLM(str(model), device="cpu", dtype="float32", max_num_batched_tokens=64, **settings)
        try:
            return [o.token_ids for o in llm.generate(prompts, GREEDY)], llm.engine.speculator
        finally:
            llm.engine.close()

    tokens, speculator = generate(**SPEC, tensor_parallel_size=2)
    assert tokens == generate()[0] and speculator.stats.accepted_tokens


class ScriptedProposer:
    """Drafts each sequence's greedy continuation (from `reference`, by prompt), every token of it off by one where
    wrong(tokens generated so far) holds, and records when each sequence was asked for a draft."""

    def __init__(self, reference: dict[tuple, list[int]], vocab: int, wrong):
        self.reference, self.vocab, self.wrong = reference, vocab, wrong
        self.asked: dict[str, list[int]] = defaultdict(list)

    def propose(self, seqs, limits):
        drafts = []
        for seq, k in zip(seqs, limits):
            done = len(seq.token_ids) - seq.num_prompt_tokens
            self.asked[seq.request_id].append(done)
            truth = self.reference[tuple(seq.prompt_token_ids)][done:done + k]
            drafts.append([(t + 1) % self.vocab for t in truth] if self.wrong(done) else truth)
        return drafts


@pytest.mark.parametrize("wrong, min_acceptance, asked, pauses", [
    # Nine rejected drafts take the average (from 1.0, times 0.8 each time) below 0.15: no drafts for 8 tokens,
    # then one try, rejected: 16 tokens, then 32 (the next try would come after the 40th token).
    (lambda done: True, 0.15, [1, 2, 3, 4, 5, 6, 7, 8, 9, 18, 35], 3),
    # The same pause, but the try after it is accepted (k = 4, five tokens a step): it speculates every step again.
    (lambda done: done < 10, 0.15, [1, 2, 3, 4, 5, 6, 7, 8, 9, 18, 23, 28, 33, 38], 1),
    # Copy-heavy with misses (every draft made at a multiple of 3 rejected): never paused, every step drafts.
    (lambda done: done % 3 == 0, 0.15, [1, 6, 7, 12, 13, 18, 19, 24, 25, 30, 31, 36, 37], 0),
    (lambda done: True, 0.0, list(range(1, 39)), 0),  # no back-off: drafts however they fare
], ids=["always-rejected", "copies-again", "copy-heavy", "off"])
def test_the_acceptance_back_off_pauses_failing_drafts_and_resumes(prompts, plain, wrong, min_acceptance, asked,
                                                                  pauses):
    """With async scheduling, as on the GPU: the steps of a pause (every sequence pausing together here) overlap as
    plain decoding's do, and the others run synchronously."""
    llm = make_llm(**SPEC, speculative_min_acceptance=min_acceptance, async_scheduling=True)
    tokenizer, engine, speculator = llm.tokenizer, llm.engine, llm.engine.speculator
    reference = {tuple(tokenizer.encode(p)): out for p, out in zip(prompts, plain)}
    speculator.proposer = ScriptedProposer(reference, llm.engine.model.config.vocab_size, wrong)
    run, overlapped = engine.runner.run, []

    def recording_run(batch, pending):
        overlapped.append(engine._in_flight is not None)  # launched while the step before is in flight
        return run(batch, pending)

    engine.runner.run = recording_run
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    # The steps of a pause of 8 tokens after its first (which follows a verify, completed at once) overlap
    assert (sum(overlapped) >= 7) == (pauses > 0)
    assert list(speculator.proposer.asked.values()) == [asked] * len(prompts)
    assert speculator.stats.drafts == len(asked) * len(prompts)
    assert speculator.stats.backoffs == pauses * len(prompts)
    llm.engine.step()  # the next step forgets the finished sequences
    assert not speculator.acceptance
    assert_no_leaks(llm)


def test_block_manager_reserves_draft_slots_and_gives_back_rejected_blocks():
    bm = BlockManager(16, 4)
    tokens = list(range(10, 17))  # 7 tokens: 2 blocks
    bm.allocate("s", tokens)
    tokens.append(17)  # a decode's new token, with 5 draft slots after it: positions 7..12, 4 blocks
    assert bm.append("s", tokens, lookahead=5) == [] and len(bm.tables["s"]) == 4
    assert bm.num_tokens["s"] == 8 and len(bm.hashes["s"]) == 1  # drafts are not the sequence's: not published
    tokens += [18, 19]  # one draft accepted, then the target's token: 10 tokens, 3 blocks
    bm.truncate("s", len(tokens))
    assert len(bm.tables["s"]) == 3 and bm.num_free_blocks == 13
    bm.append("s", tokens)
    assert len(bm.hashes["s"]) == 2  # the block of tokens 4..7, all accepted, wholly before the last one
    # A sequence that shares its last block (a fork) copies it before its drafts' slots are written.
    bm.fork("s", "t")
    assert bm.append("t", tokens + [20], lookahead=3) == [(bm.tables["s"][2], bm.tables["t"][2])]
    bm.free("s")
    bm.free("t")
    assert bm.num_free_blocks == 16


def test_ngram_lookup_prefers_long_recent_matches():
    proposer = NgramProposer(1, 3)
    assert proposer.lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # latest of two 3-gram matches
    assert proposer.lookup([4, 2, 3, 8, 6, 5, 2, 3], 3) == [8, 6, 5]  # the 2-gram (2, 3)
    assert proposer.lookup([4, 2, 3, 8, 6, 5, 7, 3], 4) == [8, 6, 5, 7]  # the 1-gram (3)
    assert proposer.lookup([1, 2, 3, 4], 3) == [] and proposer.lookup([5, 5], 0) == []
    assert NgramProposer(2, 3).lookup([4, 2, 3, 8, 6, 5, 7, 3], 4) == []
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9] and accept_greedy([5], [5, 8]) == [5, 8]


def test_ngram_index_finds_what_a_scan_finds_as_a_sequence_grows():
    """The incremental index (a prompt at once, then a few tokens a step) against a scan of all earlier windows."""
    def scan(tokens, k, min_n, max_n):
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1:e + 1] == tokens[-n:]]
            if ends:
                return tokens[ends[-1] + 1:ends[-1] + 1 + k]
        return []

    rng = random.Random(0)
    for _ in range(300):
        vocab, (min_n, max_n) = rng.choice([2, 3, 20, 500]), rng.choice([(1, 3), (2, 4), (3, 3)])
        tokens, index = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))], NgramIndex(min_n, max_n)
        for _ in range(5):
            index.update(tokens)
            for k in (0, 1, 4):
                want = scan(tokens, k, min_n, max_n) if k and len(tokens) > min_n else []
                assert index.lookup(tokens, k) == want, (tokens, k, min_n, max_n)
            tokens += [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 4, 30]))]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("bias", [False, True])
def test_greedy_verification_takes_the_steps_argmax_where_the_step_computed_one(bias):
    """A decode graph's argmax decides a greedy verify (the tokens plain decoding's graph would pick, even where
    its kernel breaks a tie otherwise than torch), unless the request has a logit bias; the plain rows are left to
    the sampler."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    best = logits.argmax(-1).tolist()
    params = SamplingParams(max_new_tokens=10, temperature=0.0, logit_bias={7: 0.5} if bias else {})
    seqs = [Sequence("verified", [1, 2, 3], params), Sequence("plain", [4, 5], GREEDY)]
    index, drafts = [0, 0, 0, 1, 0], {0: [best[0], best[1], 9]}  # rows 0-2 and 4 verify seqs[0]'s draft
    graph = logits.argmax(-1)
    graph[2] = (best[2] + 1) % 50  # where the graph's argmax differs from torch's
    speculator = Speculator(NgramProposer(1, 3), 3, None, 100, 0.0)
    biased = logits.clone()
    biased[:, 7] += 0.5 if bias else 0.0
    expected = accept_greedy(drafts[0], biased[[0, 1, 2, 4]].argmax(-1).tolist())
    for argmax, want in ((None, expected), (graph, expected if bias else [best[0], best[1], graph[2].item()])):
        kept, plain, verified = speculator.verify(logits, index, drafts, seqs, argmax)
        assert verified == [(seqs[0], want)] and plain == [1] and torch.equal(kept, logits[[3]])


def test_rejection_sampling_draws_from_the_target_distribution():
    """20,000 sequences, each with the draft [d1, d2] over three rows of fixed target distributions: the first new
    token follows p0, the second (after d1 was accepted) p1, the third (after both) p2. Skipping the rejection
    (accepting every draft) would make d1 certain: the first test's statistic is checked to catch that."""
    p = torch.tensor([[0.1, 0.3, 0.05, 0.25, 0.2, 0.1],
                      [0.4, 0.1, 0.1, 0.1, 0.2, 0.1],
                      [0.05, 0.05, 0.3, 0.3, 0.2, 0.1]])
    n, d1, d2 = 20000, 1, 4
    tokens = accept_sampled(p.repeat(n, 1), [[d1, d2]] * n, [None] * n)
    vocab = p.shape[1]
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=vocab).float()
    second = torch.bincount(torch.tensor([t[1] for t in tokens if t[0] == d1]), minlength=vocab).float()
    third = torch.bincount(torch.tensor([t[2] for t in tokens if t[:2] == [d1, d2]]), minlength=vocab).float()
    critical = 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    assert _chi_square(first, p[0]) < critical
    assert _chi_square(second, p[1]) < critical
    assert _chi_square(third, p[2]) < critical
    assert all(len(t) == 3 or t[-1] != [d1, d2][len(t) - 1] for t in tokens)  # a rejected draft is never redrawn
    always_accepted = torch.zeros(vocab)
    always_accepted[d1] = n
    assert _chi_square(always_accepted, p[0]) > 1000 * critical


def test_seeded_sampling_is_reproducible_and_fallbacks_do_not_speculate(prompts):
    llm = make_llm(**SPEC)
    sampled = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=7,
                             logit_bias={16: 2.0}, ignore_eos=True, n=2)
    first, again = (llm.generate(prompts[:2], sampled) for _ in range(2))
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert first[0].token_ids != first[1].token_ids  # each completion draws with its own seed
    spec = llm.engine.speculator.stats
    assert spec.drafts
    drafts = spec.drafts
    for params in (SamplingParams(max_new_tokens=16, temperature=0.0, logprobs=True),
                   SamplingParams(max_new_tokens=16, temperature=0.0, repetition_penalty=1.2),
                   SamplingParams(max_new_tokens=16, temperature=0.0, min_tokens=16, ignore_eos=True)):
        llm.generate(prompts[:2], params)
        assert spec.drafts == drafts
    busy = make_llm(**SPEC, speculative_disable_by_batch_size=2)
    busy.generate(prompts[:2], GREEDY)
    assert busy.engine.speculator.stats.drafts == 0
    assert_no_leaks(llm)


def test_vllm_speculative_series():
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, 0, "m", 16, 100, num_speculative_tokens=3)
    metrics.record_spec(4, 10, 6, [4, 2, 0])
    metrics.record_spec(5, 13, 8, [5, 3, 0], proposer_failures=2)
    text = generate_latest(registry).decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 13.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 8.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0' in text
    assert 'llm_spec_decode_proposer_failures_total{engine="0"} 2.0' in text
    assert "spec_decode" not in generate_latest(_plain_registry()).decode()


def _plain_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    EngineMetrics(registry, 0, "m", 16, 100)
    return registry


def test_steps_that_do_not_propose_overlap(prompts, plain):
    """Async scheduling with speculation off at 3 running sequences or more: those steps overlap (one is in flight
    when step() returns), the later ones propose (after completing the step in flight) and a step that verifies
    completes at once; greedy outputs are plain decoding's (prefixes of it: four requests ending after 10, 20, 30
    and 40 tokens)."""
    llm = make_llm(**SPEC, async_scheduling=True, speculative_disable_by_batch_size=3)
    engine, lengths, in_flight = llm.engine, [10, 20, 30, 40], []
    step = engine.step

    def recording_step():
        proposing, drafts = engine.speculator.active(engine.scheduler.running), engine.speculator.stats.drafts
        result = step()
        in_flight.append((proposing, engine.speculator.stats.drafts > drafts, engine._in_flight is not None))
        return result

    engine.step = recording_step
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = [o.token_ids for o in llm.generate(prompts[:4], params)]
    assert outputs == [p[:n] for p, n in zip(plain[:4], lengths)]
    assert any(flying for proposing, _, flying in in_flight if not proposing)
    assert any(verified for _, verified, _ in in_flight)
    assert not any(flying for _, verified, flying in in_flight if verified)
    assert engine.speculator.stats.accepted_tokens
    assert_no_leaks(llm)


def plans_of_verifies(llm) -> list:
    """Records the plan of every step of llm's runner that verifies drafts."""
    runner, plans = llm.engine.runner, []
    plan = runner.plan

    def recording(batch, pending):
        planned = plan(batch, pending)
        if batch.drafts:
            plans.append(planned[0])
        return planned

    runner.plan = recording
    return plans


@pytest.mark.parametrize("verify_as_decode", [True, False])
def test_verify_rows_run_as_decode_rows(prompts, plain, monkeypatch, verify_as_decode):
    """A step of verifies runs as decode rows, one per token (the runner's doc), or, where the attention kernel
    writes the K/V itself (DECODE_ROPE_IN_ATTENTION), through the prefill path: the same greedy tokens either way."""
    from kernels import configs
    monkeypatch.setattr(configs, "DECODE_ROPE_IN_ATTENTION", not verify_as_decode)
    llm = make_llm(**SPEC)
    plans = plans_of_verifies(llm)
    assert [o.token_ids for o in llm.generate(prompts[:4], GREEDY)] == plain[:4]
    assert plans and all(p.decode == verify_as_decode for p in plans)
    assert all(p.num_seqs == (p.num_tokens if verify_as_decode else p.num_seqs) for p in plans)
    assert any(p.num_tokens > 1 for p in plans)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("rope_in_attention", [False, True])
def test_greedy_outputs_on_the_gpu(prompts, graphs, rope_in_attention, monkeypatch):
    """On CUDA, float32: verify steps as decode rows through the decode kernel (replayed from the decode graphs when
    `graphs`), or, with RoPE in the attention kernel, through our prefill kernel (and the prefill graphs), give the
    tokens that plain decode steps give."""
    from kernels import configs
    from service.engine.model_runner import DECODE_GRAPH, PREFILL_GRAPH
    monkeypatch.setattr(configs, "DECODE_ROPE_IN_ATTENTION", rope_in_attention)
    outs = {}
    for method in (None, "ngram"):
        llm = LLM(None, device="cuda", dtype="float32", num_kv_blocks=512, cuda_graphs=graphs,
                  **(SPEC if method else {}))
        plans = plans_of_verifies(llm)
        outs[method] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        if method:
            assert llm.engine.speculator.stats.accepted_tokens and plans
            if graphs:
                assert {p.kind for p in plans} == {PREFILL_GRAPH if rope_in_attention else DECODE_GRAPH}
        assert_no_leaks(llm)
        del llm
        torch.cuda.empty_cache()
    assert outs["ngram"] == outs[None]


def test_decode_graph_inputs_of_a_verify_and_of_the_step_after_its_rejections():
    """The host side of a verify through a decode graph (runner.plan with graphs it pretends to hold; the GPU test
    above replays them): a row per token at its own position, slot and key count in its sequence's table row; then
    the verify's lookahead block given back (its drafts rejected) and a plain decode step: the table row's new last
    entry rewritten."""
    from service.engine.model_runner import DECODE_GRAPH
    from service.engine.scheduler import ScheduledBatch

    llm = make_llm(**SPEC)
    engine, runner = llm.engine, llm.engine.runner
    engine.add_request("r", list(range(100, 127)), GREEDY)  # 27 tokens: the 28th's slot is the 12th of block 1
    while not engine.scheduler.running or engine.scheduler.running[0].num_computed_tokens < 27:
        engine.step()
    seq, bm, size = engine.scheduler.running[0], engine.scheduler.block_manager, runner.block_size
    runner.graphs, runner._free_table_rows = dict.fromkeys([1, 2, 4, 8]), list(range(8))

    def step(draft: list[int]) -> tuple:
        batch = ScheduledBatch()
        assert bm.append(seq.request_id, seq.cache_keys, len(draft)) is not None
        batch.seqs, batch.starts, batch.num_tokens = [seq], [seq.num_computed_tokens], [1 + len(draft)]
        batch.is_prefill, batch.block_tables = [False], [bm.tables[seq.request_id]]
        if draft:
            batch.drafts[0] = draft
        plan, index = runner.plan(batch, None)
        assert plan.kind == DECODE_GRAPH and index == [0] * (1 + len(draft))
        return plan.key[0], *plan.arrays

    start, table = seq.num_computed_tokens, bm.tables[seq.request_id]
    key, rows, updates = step([7, 8, 9, 10, 11, 12])  # 7 rows: positions 28..34 cross into block 2
    assert key == 8 and len(table) == 3
    positions = list(range(start, start + 7))
    assert rows[:7, 2].tolist() == positions and rows[:7, 4].tolist() == [p + 1 for p in positions]
    assert rows[:7, 3].tolist() == [table[p // size] * size + p % size for p in positions]
    assert len(set(rows[:7, 5].tolist())) == 1 and (rows[7:, 3] == -1).all()
    assert sorted(updates[:, 1].tolist()) == [0, 1, 2] and updates[2, 2] == table[2]
    engine.scheduler.accept(seq, 0)  # every draft token rejected: the lookahead's block goes back
    assert len(table) == 2
    _, rows, updates = step([])
    assert updates.tolist() == [[rows[0, 5], 1, table[1]]]
