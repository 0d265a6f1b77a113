"""A request's n completions (OpenAI `n`, TGI `best_of`) hold places in a step from the moment their prompt is
admitted: no step runs or samples more than max_num_seqs sequences (the decode CUDA graphs and their static buffers,
the previous step's sampled tokens included, are sized for that many), neither when requests arrive while the prompt
is computed in chunks nor when others of the same client fill the step beside it. The completions and the other
requests all finish, and every KV block goes back to the pool. Embedded model, CPU; plain and speculative decoding,
synchronous and overlapped scheduling."""
from collections import Counter

import msgspec
import pytest

from service.engine.llm import LLM
from service.protocol import SamplingParams

SAMPLED = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
LONG_PROMPT = [(17 * i) % 4000 + 10 for i in range(40)]  # three chunks at 16 tokens a step
STREAM_STEPS = 45
SPEC = dict(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)


def watched_llm(**settings) -> tuple[LLM, list[str]]:
    """The engine, and the steps that held or sampled more than max_num_seqs sequences (kept for the message)."""
    llm = LLM(None, device="cpu", dtype="float32", **settings)
    scheduler, limit, over = llm.engine.scheduler, settings["max_num_seqs"], []
    schedule = scheduler.schedule

    def checked_schedule():
        batch = schedule()
        running, sampled = len(scheduler.running), len(batch.seqs) + len(batch.forks)
        if running > limit or sampled > limit:
            over.append(f"step {scheduler.steps}: {running} running, {len(batch.seqs)} scheduled and "
                        f"{len(batch.forks)} forked (max_num_seqs {limit})")
        return batch

    scheduler.schedule = checked_schedule
    return llm, over


def run_to_end(llm: LLM) -> dict[str, list[int]]:
    tokens = {}
    while llm.engine.has_work:
        for out in llm.engine.step()[0]:
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).append(out.token_id)
    return tokens


def assert_no_leaks(llm: LLM):
    scheduler = llm.engine.scheduler
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests
    assert not scheduler.running and not scheduler.waiting and not scheduler.forking


@pytest.mark.parametrize("settings", [dict(async_scheduling=False), dict(async_scheduling=True),
                                      dict(async_scheduling=True, **SPEC)], ids=["sync", "overlapped", "speculative"])
def test_requests_arriving_while_a_fanned_out_prompt_is_chunked(settings):
    """The n=4 prompt takes three steps; three requests arrive after its first, then one every third step. Its
    completions still to fork count as running: the newcomers get their fair share of places at once (the
    completions beyond the request's share go on alone, later), instead of being admitted beside them all; and the
    completions finish while requests keep arriving."""
    llm, over = watched_llm(max_num_seqs=4, max_num_batched_tokens=16, **settings)
    engine = llm.engine
    engine.add_request("big", LONG_PROMPT, msgspec.structs.replace(SAMPLED, n=4))
    engine.step()
    arrivals, first, last, tokens, step = {}, {}, {}, Counter(), 1
    while engine.has_work or step < STREAM_STEPS:
        if step < STREAM_STEPS and (step == 1 or step % 3 == 0):
            for i in range(3 if step == 1 else 1):
                # Repeated tokens, for n-gram drafts to verify
                engine.add_request(f"small{step}.{i}", [20 + step, 30 + i, 20 + step, 30 + i], GREEDY)
                arrivals[f"small{step}.{i}"] = step
        step += 1
        for out in engine.step()[0]:
            assert out.error is None, out.error
            first.setdefault(out.request_id, step)
            last[out.request_id] = step
            tokens[out.request_id] += 1
    assert not over, over
    assert tokens == Counter({r: 6 for r in ["big", "big#1", "big#2", "big#3", *arrivals]})
    assert max(last[f"big#{i}"] for i in range(1, 4)) < STREAM_STEPS
    waits = {r: first[r] - arrivals[r] for r in arrivals}
    # The three that came together start right after the prompt's last chunk; the others wait for a place only.
    assert max(waits[f"small1.{i}"] for i in range(3)) <= 4 and max(waits.values()) <= 8, waits
    if settings.get("speculative_method"):
        assert engine.speculator.stats.drafts > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_a_clients_requests_beside_its_fanned_out_one_in_one_step(async_scheduling):
    """One client (`user`) sends an n=4 request and three single ones, another client one request: the n=4 one keeps
    two completions (its client's share is 3 of 6 places), and the client's other requests fill only the places
    left once those are counted."""
    llm, over = watched_llm(max_num_seqs=6, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    engine = llm.engine
    engine.add_request("fan", [50, 51, 52, 53, 54, 55], msgspec.structs.replace(SAMPLED, n=4), group="u")
    for i in range(3):
        engine.add_request(f"u{i}", [60 + i, 70 + i, 80 + i], GREEDY, group="u")
    engine.add_request("v", [90, 91, 92], GREEDY, group="v")
    tokens = run_to_end(llm)
    assert not over, over
    assert sorted(tokens) == ["fan", "fan#1", "fan#2", "fan#3", "u0", "u1", "u2", "v"]
    assert all(len(t) == 6 for t in tokens.values())
    assert_no_leaks(llm)
