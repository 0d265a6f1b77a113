"""Scheduling by priority (scheduling_policy "priority": lower values first, as in vLLM) and streaming every N tokens
(stream_interval): the scheduler's orders, then real servers (embedded model, CPU)."""
import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from server import serve, sse_events

from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence, Status
from service.protocol import SamplingParams


def request(rid: str, priority: int = 0, group: str = "", tokens: int = 10) -> Sequence:
    return Sequence(rid, list(range(3, 3 + tokens)), SamplingParams(max_new_tokens=100, priority=priority),
                    group=group or rid)


def step(scheduler: Scheduler) -> list[str]:
    """One step, as the engine runs it (each sampled row gains a token); the ids of the sequences admitted."""
    batch = scheduler.schedule()
    for seq in batch.seqs:
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(7)
    return [s.request_id for s, prefill in zip(batch.seqs, batch.is_prefill) if prefill]


def ids(seqs) -> list[str]:
    return [seq.request_id for seq in seqs]


def test_the_waiting_queue_is_served_by_priority_then_arrival():
    scheduler = Scheduler(64, 16, False, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256,
                          policy="priority")
    for rid, priority in [("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)]:
        scheduler.add(request(rid, priority))
    assert ids(scheduler.waiting) == ["d", "b", "e", "a", "c"]
    admitted = []
    while scheduler.waiting:
        admitted += step(scheduler)
        scheduler.free(scheduler.running[0])  # it ends: the next one gets the place
    assert admitted == ["d", "b", "e", "a", "c"]
    fcfs = Scheduler(64, 16, False, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256)
    for rid in "abc":
        fcfs.add(request(rid))
    assert ids(fcfs.waiting) == ["a", "b", "c"]


@pytest.mark.parametrize("policy, preempted", [("priority", ["a", "d"]), ("fcfs", ["c", "d"])])
def test_out_of_blocks_the_lowest_priority_newest_sequences_are_preempted_first(policy, preempted):
    # Four 16-token prompts fill the four blocks; the next step each needs a second block.
    scheduler = Scheduler(4, 16, False, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                          policy=policy)
    priorities = {"a": 2, "b": 0, "c": 0, "d": 1} if policy == "priority" else dict.fromkeys("abcd", 0)
    for rid, priority in priorities.items():
        scheduler.add(request(rid, priority, tokens=16))
    assert sorted(step(scheduler)) == ["a", "b", "c", "d"]
    step(scheduler)
    assert sorted(ids(s for s in scheduler.waiting)) == preempted
    assert all(s.status == Status.RUNNING for s in scheduler.running) and len(scheduler.running) == 2
    if policy == "priority":  # back in the queue by (priority, arrival); running by priority
        assert ids(scheduler.waiting) == ["d", "a"] and ids(scheduler.running) == ["b", "c"]


@pytest.mark.parametrize("low, high, preempts", [(5, 0, True), (0, 5, False)])
def test_fairness_takes_places_only_from_sequences_of_the_same_priority_or_lower(low, high, preempts):
    # Group g holds all four places; when h arrives, g is over its share (2 of 4).
    scheduler = Scheduler(64, 16, False, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                          policy="priority")
    for i in range(4):
        scheduler.add(request(f"g{i}", low, group="g"))
    step(scheduler)
    scheduler.add(request("h", high))
    admitted = step(scheduler)
    assert (admitted == ["h"]) == preempts
    assert ids(scheduler.waiting) == (["g3"] if preempts else ["h"])


# -- real servers ---------------------------------------------------------------------------------------------

LOW, HIGH = 24, 8


async def first_token_seconds(client, url: str, route: str, i: int, priority: int) -> float:
    """Time to the first token of a streamed request that generates 16 tokens."""
    if route == "tgi":
        path, body = "/generate_stream", {"inputs": f"Fortune {i}:", "parameters": {
            "max_new_tokens": 16, "ignore_eos": True, "priority": priority}}
    else:
        path, body = "/v1/completions", {"model": "tgi", "prompt": f"Fortune {i}:", "max_tokens": 16,
                                         "ignore_eos": True, "stream": True, "priority": priority}
    start = time.monotonic()
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        first = None
        async for line in r.aiter_lines():
            if line.startswith("data:") and first is None:
                first = time.monotonic() - start
        return first


def test_under_overload_high_priority_requests_get_their_first_token_first():
    with serve(scheduling_policy="priority", max_num_seqs=2) as url:
        async def main():
            async with httpx.AsyncClient(timeout=300) as client:
                low = [asyncio.ensure_future(first_token_seconds(client, url, "openai", i, 10)) for i in range(LOW)]
                await asyncio.sleep(0.5)  # the low-priority requests fill the queue
                high = []
                for i in range(HIGH):  # then high-priority ones arrive while it drains, on both APIs
                    high.append(asyncio.ensure_future(
                        first_token_seconds(client, url, "tgi" if i % 2 else "openai", 100 + i, -1)))
                    await asyncio.sleep(0.2)
                return await asyncio.gather(*low), await asyncio.gather(*high)

        low, high = asyncio.run(main())
    high_p99, low_p50 = np.percentile(high, 99), np.percentile(low, 50)
    assert high_p99 < low_p50, f"high-priority TTFT p99 {high_p99:.2f}s, low-priority p50 {low_p50:.2f}s"


@pytest.fixture(scope="module")
def interval_url():
    with serve(stream_interval=4) as url:  # and scheduling_policy fcfs, the default
        yield url


def test_streams_send_every_n_tokens_the_first_at_once_and_the_last_at_the_end(interval_url):
    body = {"model": "tgi", "prompt": "Once", "max_tokens": 10, "ignore_eos": True, "stream": True, "logprobs": 0}
    with httpx.stream("POST", f"{interval_url}/v1/completions", json=body, timeout=120) as r:
        chunks = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    sizes = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks]
    # Usually [1, 4, 4, 1]; a front-end that falls behind takes more at once, and sends them 4 a chunk.
    assert sizes[0] == 1 and sum(sizes) == 10 and max(sizes) == 4 and len(sizes) <= 5, sizes
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    chat = {"model": "tgi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "ignore_eos": True,
            "stream": True, "n": 2}
    with httpx.stream("POST", f"{interval_url}/v1/chat/completions", json=chat, timeout=120) as r:
        events = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    for index in range(2):
        deltas = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert deltas[0]["delta"]["role"] == "assistant" and deltas[-1]["finish_reason"] == "length"
        assert len(deltas) <= 1 + 5, deltas  # the opening, then a chunk per 4 tokens at most

    # TGI's events carry one token each: they keep doing so, sent together every 4 tokens.
    tgi = {"inputs": "Once", "parameters": {"max_new_tokens": 10, "ignore_eos": True}}
    with httpx.stream("POST", f"{interval_url}/generate_stream", json=tgi, timeout=120) as r:
        tokens = [json.loads(e) for e in sse_events(r)]
    assert [t["index"] for t in tokens] == list(range(10)) and tokens[-1]["details"]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "tgi", "prompt": "a", "max_tokens": 2, "priority": 1}, "priority"),
    ("/v1/chat/completions", {"model": "tgi", "messages": [{"role": "user", "content": "a"}], "priority": -3},
     "priority"),
    ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": 2, "priority": 2}}, "parameters.priority")])
def test_a_priority_needs_the_priority_policy(interval_url, path, body, param):
    r = httpx.post(interval_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert param in r.text and "fcfs" in r.text
    body = json.loads(json.dumps(body).replace('"priority": 1', '"priority": 0'))
    if path == "/v1/completions":  # the default, 0, is fine
        assert httpx.post(interval_url + path, json=body, timeout=60).status_code == 200
