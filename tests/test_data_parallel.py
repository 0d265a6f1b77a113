"""Data parallelism (CPU, embedded model): two engine cores behind one front-end. Requests spread over both cores,
prompts that share a prefix meet in one core's prefix cache, and a core that dies fails its requests and takes the
service down like a lone core's death does."""
import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry
from server import scrape, service_process, sse_events
from test_processes import children

from service.api.engine_client import AFFINITY_SLACK, EngineClient
from service.metrics import FrontendMetrics

LONG = {"inputs": "A man walks into a bar", "parameters": {"max_new_tokens": 1500, "ignore_eos": True}}
BLOCK = 16  # the default block_size


@pytest.fixture(scope="module")
def service():
    # One front-end, so that every request is routed with the same view of the cores' loads. The last test kills
    # a core: the other core's request then gets a short drain.
    with service_process(data_parallel_size=2, api_server_count=1, drain_seconds=3) as service:
        yield service


def by_engine(metrics: dict, name: str) -> dict[str, float]:
    """{engine index: value} of an engine core's series."""
    return {dict(labels)["engine"]: value for (sample, labels), value in metrics.items() if sample == name}


def moved(before: dict, after: dict, name: str) -> dict[str, float]:
    old, new = by_engine(before, name), by_engine(after, name)
    return {engine: new[engine] - old.get(engine, 0) for engine in new}


def token_ids(url: str, text: str) -> list[int]:
    return [t["id"] for t in httpx.post(f"{url}/tokenize", json={"inputs": text}).json()]


def test_the_routing_rule():
    """EngineClient._route alone: prefix affinity, bounded by load."""
    client = EngineClient(["ipc://core-0", "ipc://core-1"], "test", FrontendMetrics(CollectorRegistry()))
    try:
        prompt = list(range(100, 180))  # five blocks
        home = client._route(prompt, None)
        other = client.cores[1 - home.index]
        for tail in ([], [7], list(range(50))):  # the first four blocks decide
            assert client._route(prompt[:4 * BLOCK] + tail, None) is home
        assert client._route(prompt[:BLOCK - 1], None) is client.cores[0]  # under a block: least loaded, ties: 0
        assert client._route(prompt, "an-adapter") is home  # every core serves every adapter

        def load(core, n):
            core.streams = dict.fromkeys(map(str, range(n)))

        load(home, AFFINITY_SLACK)
        assert client._route(prompt, None) is home
        load(home, AFFINITY_SLACK + 1)
        assert client._route(prompt, None) is other
        load(other, 10)
        load(home, 15)  # 5 more, and half as many again as 10: not yet "much more"
        assert client._route(prompt, None) is home
        load(home, 16)
        assert client._route(prompt, None) is other and client._route(prompt[:3], None) is other
    finally:
        client.context.term()


def test_requests_spread_over_both_cores(service):
    assert {"llm-core-0", "llm-core-1", "llm-api-0"} <= set(children(service.process.pid))  # llm-engine-core-K
    before = scrape(service.url)

    async def one(client, i):
        # short prompts (under a block) go to the least loaded core; longer ones to the core their start hashes to
        text = f"fortune {i}" if i % 2 else f"{i}: " + "the words of a longer prompt " * (3 + i % 5)
        r = await client.post("/generate", json={"inputs": text, "parameters": {"max_new_tokens": 8}})
        return r.status_code

    async def run():
        async with httpx.AsyncClient(base_url=service.url, timeout=60, limits=httpx.Limits(max_connections=32)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    assert asyncio.run(run()) == [200] * 32
    deadline = time.monotonic() + 10
    while any(by_engine(after := scrape(service.url), "llm_requests_running").values()):
        assert time.monotonic() < deadline, by_engine(after, "llm_requests_running")
        time.sleep(0.05)
    steps = moved(before, after, "llm_engine_step_seconds_count")
    assert set(steps) == {"0", "1"} and all(count > 0 for count in steps.values()), steps
    for name in ("llm_requests_waiting", "llm_kv_cache_usage_ratio", "llm_prefix_cache_queried_tokens_total"):
        assert set(by_engine(after, name)) == {"0", "1"}, name
    generated = after[("llm_generation_tokens_total", ())] - before[("llm_generation_tokens_total", ())]
    assert generated > 32 and httpx.get(f"{service.url}/health").status_code == 200
    assert httpx.get(f"{service.url}/v1/fine_tuning/jobs").json()["data"] == []  # a call, answered by core 0


def test_prompts_sharing_a_prefix_meet_in_one_cores_prefix_cache(service):
    prefix = " ".join(f"Rule {i}: a fortune told twice is worth half." for i in range(24))
    first, second = prefix + " And so it rained all day.", prefix + " Nobody knew why the cat left."
    a, b = token_ids(service.url, first), token_ids(service.url, second)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared >= 200, shared

    def generate(text):
        r = httpx.post(f"{service.url}/generate", json={"inputs": text, "parameters": {"max_new_tokens": 4}},
                       timeout=60)
        assert r.status_code == 200, r.text

    start = scrape(service.url)
    generate(first)
    middle = scrape(service.url)
    generate(second)
    end = scrape(service.url)
    looked_up = moved(start, middle, "llm_prefix_cache_queried_tokens_total")
    (core,) = [engine for engine, tokens in looked_up.items() if tokens > 0]  # the first prompt's core
    hits = moved(middle, end, "llm_prefix_cache_hit_tokens_total")
    assert hits[core] >= shared // BLOCK * BLOCK, (core, hits, shared)
    assert all(tokens == 0 for engine, tokens in hits.items() if engine != core), hits
    assert moved(middle, end, "llm_prefix_cache_queried_tokens_total")[core] > 0


def test_a_killed_core_fails_its_requests_and_the_service_exits_non_zero(service):
    """The last test of the module: it ends the service."""
    victim = children(service.process.pid)["llm-core-1"]
    results, streaming = {}, {"0": threading.Event(), "1": threading.Event()}

    def stream(name):
        events = []
        try:
            with httpx.stream("POST", f"{service.url}/generate_stream", json=LONG, timeout=60) as r:
                for data in sse_events(r):
                    events.append(json.loads(data))
                    if len(events) == 3:
                        streaming[name].set()
        finally:
            results[name] = events

    # Short prompts go to the least loaded core: the first stream to core 0 (ties go to the lowest index), the
    # second, sent while the first runs, to core 1.
    threads = {name: threading.Thread(target=stream, args=(name,)) for name in ("0", "1")}
    threads["0"].start()
    assert streaming["0"].wait(30)
    threads["1"].start()
    assert streaming["1"].wait(30)
    os.kill(victim, signal.SIGKILL)
    threads["1"].join(30)
    assert not threads["1"].is_alive()
    last = results["1"][-1]
    assert last.get("error_type") == "generation" and "engine core" in last["error"], last
    assert httpx.get(f"{service.url}/health").status_code == 503
    r = httpx.post(f"{service.url}/generate", json={"inputs": "a"})
    assert r.status_code == 503 and r.json()["error_type"] == "unavailable"
    # Core 0's stream ends too: it finished, or the drain (3 s) ended it with an error of ours.
    threads["0"].join(60)
    assert not threads["0"].is_alive()
    last = results["0"][-1]
    assert "details" in last or (last.get("error_type") == "generation" and "shut down" in last["error"]), last
    assert service.process.wait(timeout=60) == 1
    assert "llm-engine-core-1 exited" in service.log.read_text(errors="replace")
