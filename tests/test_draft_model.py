"""Speculative decoding with a draft model (service/engine/draft_model.py) on the CPU, with the embedded (trained)
model as the target: the proposer drafts the draft model's own greedy continuation, after rollbacks too, and nothing
for a sequence its cache cannot hold; greedy outputs are those of plain decoding with the target as its own draft
(acceptance ~1) and with a tiny random model of its vocabulary, through chunked prefill, prefix-cache hits and
preemption; the draft's KV blocks all come back when requests finish or are aborted; the settings' checks."""
import functools
import gzip

import pydantic
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from tiny_models import VOCAB, make_tiny_model

from service.config import DEFAULT_MODEL_DIR, Settings
from service.engine.draft_model import load_proposer
from service.engine.llm import LLM
from service.engine.sequence import Sequence, Status
from service.metrics import EngineMetrics
from service.model.config import ModelConfig
from service.protocol import SamplingParams
from service.text import load_tokenizer

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
SMALL = dict(device="cpu", dtype="float32", cpu_kv_cache_bytes=16 << 20)  # a small cache: fast to allocate


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The target, the embedded model (trained: what it drafts depends on the whole context), and another draft of
    its vocabulary: a 1-layer random Llama, whose context (512 tokens) is also shorter."""
    return {"target": str(DEFAULT_MODEL_DIR),
            "other": str(make_tiny_model("llama", tmp_path_factory.mktemp("draft"), num_hidden_layers=1))}


@functools.cache
def corpus_ids() -> tuple[int, ...]:
    text = gzip.decompress((DEFAULT_MODEL_DIR / "corpus.txt.gz").read_bytes()).decode()[:40_000]
    return tuple(load_tokenizer(DEFAULT_MODEL_DIR).encode(text))


def prompt(i: int, length: int) -> list[int]:
    """`length` tokens of the embedded model's corpus, from the i-th of its stretches of 300 tokens."""
    return list(corpus_ids()[300 * i:300 * i + length])


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [prompt(i, length) for i, length in enumerate([12, 21, 30, 39])]


def make_llm(model: str, draft: str | None = None, **settings) -> LLM:
    spec = dict(speculative_method="draft_model", speculative_model=draft, num_speculative_tokens=4) if draft else {}
    return LLM(model, **SMALL, **spec, **settings)


def greedy_outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(models) -> LLM:
    return make_llm(models["target"], enable_prefix_caching=False)


def assert_draft_cache_empty(llm: LLM) -> None:
    proposer = llm.engine.speculator.proposer
    assert proposer.num_free_blocks == proposer.num_blocks and not proposer.drafts


def test_the_proposer_drafts_the_draft_models_greedy_continuation(models):
    """Real sequences, proposed for by hand: each draft is what the draft model generates greedily; after the target
    rejected a draft (or accepted all of it) the next one starts from the sequence's tokens; a sequence whose tokens
    and draft do not fit the free blocks gets none; a preempted sequence's blocks are freed by the next proposal."""
    settings = Settings(**SMALL, speculative_method="draft_model", speculative_model=models["target"],
                        num_kv_blocks=6)  # 16-token blocks
    proposer = load_proposer(settings, torch.device("cpu"), torch.float32, 2048,
                             ModelConfig.from_dir(models["target"]))
    reference = make_llm(models["target"], enable_prefix_caching=False)

    def continuation(seq: Sequence, k: int) -> list[int]:
        return greedy_outputs(reference, [seq.token_ids], SamplingParams(max_new_tokens=k, temperature=0.0,
                                                                          ignore_eos=True))[0]

    def sequence(rid: str, length: int) -> Sequence:
        seq = Sequence(rid, prompt(len(rid), length), GREEDY)
        seq.status = Status.RUNNING
        return seq

    a, b, c = sequence("a", 30), sequence("bb", 20), sequence("ccc", 40)
    drafts = proposer.propose([a, b], [4, 3])
    assert drafts == [continuation(a, 4), continuation(b, 3)]
    assert proposer.num_free_blocks == 1  # a: 30 + 3 slots, 3 blocks; b: 20 + 2, 2 blocks
    a.token_ids += drafts[0][:2] + [(drafts[0][2] + 1) % VOCAB]  # two accepted, then the target's own token
    b.token_ids += [(drafts[1][0] + 1) % VOCAB, 7, 8, 9, 10]  # tokens of its own (backing off, say)
    drafts = proposer.propose([a, b], [4, 2])
    assert drafts == [continuation(a, 4), continuation(b, 2)]
    a.token_ids += drafts[0] + [7]  # all accepted
    assert proposer.propose([c, a], [4, 4]) == [[], continuation(a, 4)]  # c needs 3 blocks, 1 is free
    assert proposer.num_free_blocks == 1 and c not in proposer.drafts
    assert proposer.propose([a], [4]) == [continuation(a, 4)]  # the step dropped its draft: a has no new token
    a.status = Status.WAITING  # preempted: the next proposal frees its blocks, and c fits
    assert proposer.propose([c], [4]) == [continuation(c, 4)]
    assert a not in proposer.drafts
    proposer.release(b)
    proposer.release(c)
    assert proposer.num_free_blocks == proposer.num_blocks


@pytest.mark.parametrize("draft", ["target", "other"])
def test_greedy_outputs_are_those_of_plain_decoding(models, plain, prompts, draft):
    llm = make_llm(models["target"], models[draft])
    assert greedy_outputs(llm, prompts) == greedy_outputs(plain, prompts)
    stats = llm.engine.speculator.stats
    assert stats.drafts and stats.accepted_tokens <= stats.draft_tokens
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    if draft == "target":  # the same model drafts the tokens it then verifies
        assert stats.accepted_tokens / stats.draft_tokens > 0.9
    # A seeded sampled request (rejection sampling of the greedy drafts) is reproducible.
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    assert greedy_outputs(llm, prompts[:2], sampled) == greedy_outputs(llm, prompts[:2], sampled)
    assert_draft_cache_empty(llm)
    registry = CollectorRegistry()  # the spec_decode series count the draft model's drafts as any proposer's
    EngineMetrics(registry, 0, "m", 16, 100, num_speculative_tokens=4).record_spec(
        stats.drafts, stats.draft_tokens, stats.accepted_tokens, stats.accepted_per_position)
    text = generate_latest(registry).decode()
    assert f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {stats.draft_tokens:.1f}' in text


def test_chunked_prefill_and_prefix_cache_hits(models, plain):
    """A 100-token prompt in 32-token steps: the target's prefill and the draft's first catch-up both come in
    chunks; a second prompt that shares its first 64 tokens hits the target's prefix cache (the draft, which has
    none, computes it all)."""
    llm = make_llm(models["target"], models["target"], max_num_batched_tokens=32)
    proposer, sizes = llm.engine.speculator.proposer, []
    run = proposer.runner.run
    proposer.runner.run = lambda batch, pending: sizes.append(sum(batch.num_tokens)) or run(batch, pending)
    first, second = prompt(1, 100), prompt(1, 64) + prompt(2, 30)
    assert greedy_outputs(llm, [first]) == greedy_outputs(plain, [first])
    assert max(sizes) == 32 and sizes[:4] == [32, 32, 32, 5]  # the catch-up: the prompt and the first token
    bm = llm.engine.scheduler.block_manager
    hits = bm.prefix_hit_tokens
    assert greedy_outputs(llm, [second]) == greedy_outputs(plain, [second])
    assert bm.prefix_hit_tokens - hits == 64
    assert llm.engine.speculator.stats.accepted_tokens / llm.engine.speculator.stats.draft_tokens > 0.9
    assert_draft_cache_empty(llm)


def test_preemption_and_a_full_draft_cache(models, plain, prompts):
    """A cache of 10 blocks (the target's, and so the draft's) for four sequences that need 4 each: the target
    preempts, the draft proposes nothing for the sequences it cannot hold, and outputs do not change."""
    llm = make_llm(models["target"], models["target"], num_kv_blocks=10)
    stats, step = [], llm.engine.step

    def counting_step():
        outputs, s = step()
        stats.append(s)
        return outputs, s

    llm.engine.step = counting_step
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    assert greedy_outputs(llm, prompts, params) == greedy_outputs(plain, prompts, params)
    assert sum(s.num_preemptions for s in stats if s) and llm.engine.speculator.stats.accepted_tokens
    assert_draft_cache_empty(llm)


def test_aborted_requests_give_the_draft_its_blocks_back(models, prompts):
    llm = make_llm(models["target"], models["other"], speculative_min_acceptance=0.0)
    engine, proposer = llm.engine, llm.engine.speculator.proposer
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("x", prompts[0], params)
    engine.add_request("y", prompts[1], params)
    while {seq.request_id for seq in proposer.drafts} != {"x", "y"}:
        engine.step()
    held = proposer.num_blocks - proposer.num_free_blocks
    engine.abort("x")
    assert {seq.request_id for seq in proposer.drafts} == {"y"}
    assert 0 < proposer.num_blocks - proposer.num_free_blocks < held
    engine.step()
    engine.abort("y")
    assert_draft_cache_empty(llm)
    assert not engine.has_work


def test_a_failing_draft_costs_its_steps_their_drafts_only(models, plain, prompts, caplog):
    """The draft model raises in one proposal: that step runs without drafts, the draft's state is dropped and
    rebuilt, and speculation goes on; raising three proposals in a row turns speculation off for good. Outputs stay
    those of plain decoding throughout, and the draft's blocks all come back."""
    llm = make_llm(models["target"], models["target"])
    speculator = llm.engine.speculator
    proposer = speculator.proposer
    run, calls = proposer.runner.run, []

    def failing(fail_at):
        def step(batch, pending):
            calls.append(1)
            if len(calls) in fail_at:
                raise RuntimeError("injected draft failure")
            return run(batch, pending)
        return step

    proposer.runner.run = failing({6})  # a decode step of the draft, mid-proposal: blocks held, views grown
    assert greedy_outputs(llm, prompts) == greedy_outputs(plain, prompts)
    assert speculator.stats.proposer_failures == 1 and speculator.failures_in_a_row == 0
    drafts_after_failure = speculator.stats.drafts
    assert drafts_after_failure and speculator.stats.accepted_tokens / speculator.stats.draft_tokens > 0.9
    assert_draft_cache_empty(llm)
    assert "injected draft failure" in caplog.text

    calls.clear()
    proposer.runner.run = failing(set(range(1, 1000)))
    assert greedy_outputs(llm, prompts) == greedy_outputs(plain, prompts)
    assert speculator.stats.proposer_failures == 4 and speculator.stats.drafts == drafts_after_failure
    assert len(calls) == 3  # no proposal after the third failure in a row
    assert "speculation is off from now on" in caplog.text
    assert_draft_cache_empty(llm)


def test_settings_checks(models, tmp_path):
    with pytest.raises(pydantic.ValidationError, match="needs speculative_model"):
        Settings(speculative_method="draft_model")
    with pytest.raises(pydantic.ValidationError, match="draft model of speculative_method draft_model"):
        Settings(speculative_method="ngram", speculative_model=models["other"])
    small_vocab = make_tiny_model("llama", tmp_path, vocab_size=VOCAB // 2)
    with pytest.raises(ValueError, match="vocabulary of 2048 tokens, the model 4096"):
        make_llm(models["target"], str(small_vocab))
