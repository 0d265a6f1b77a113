"""The model-server series under vLLM's names (service/metrics.py), which inference gateways, autoscalers and
dashboards written for vLLM read. A running service with two engine cores and two front-ends (CPU, embedded model)
is scraped and its text parsed with prometheus_client's parser: every name, type and label shape; per-engine
gauges for both cores; request series that add up to the requests sent, whichever front-end served them, under the
engine label of the core that ran them. tests/test_observability.py checks the same series through a real
Prometheus, and vLLM's own dashboard against them."""
import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from server import scrape, service_process, sse_events

from service.engine.core import LORA_INTERVAL, EngineCore
from service.metrics import EngineMetrics, exposition

ENGINES = {"0", "1"}
MODEL_AND_ENGINE = {"model_name", "engine"}
# Family name (the parser drops a counter's _total) -> (type, label names; histograms' `le` aside). vLLM's names,
# types and labels (vllm/v1/metrics/loggers.py).
SERIES = {
    "vllm:num_requests_running": ("gauge", MODEL_AND_ENGINE),
    "vllm:num_requests_waiting": ("gauge", MODEL_AND_ENGINE),
    "vllm:kv_cache_usage_perc": ("gauge", MODEL_AND_ENGINE),
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
    "vllm:cache_config_info": ("gauge", {"engine", "block_size", "num_gpu_blocks"}),
    "vllm:time_to_first_token_seconds": ("histogram", MODEL_AND_ENGINE),
    "vllm:inter_token_latency_seconds": ("histogram", MODEL_AND_ENGINE),
    "vllm:e2e_request_latency_seconds": ("histogram", MODEL_AND_ENGINE),
    "vllm:request_queue_time_seconds": ("histogram", MODEL_AND_ENGINE),
    "vllm:request_prefill_time_seconds": ("histogram", MODEL_AND_ENGINE),
    "vllm:request_decode_time_seconds": ("histogram", MODEL_AND_ENGINE),
    "vllm:request_prompt_tokens": ("histogram", MODEL_AND_ENGINE),
    "vllm:request_generation_tokens": ("histogram", MODEL_AND_ENGINE),
    "vllm:request_max_num_generation_tokens": ("histogram", MODEL_AND_ENGINE),
    "vllm:prompt_tokens": ("counter", MODEL_AND_ENGINE),
    "vllm:generation_tokens": ("counter", MODEL_AND_ENGINE),
    "vllm:num_preemptions": ("counter", MODEL_AND_ENGINE),
    "vllm:prefix_cache_queries": ("counter", MODEL_AND_ENGINE),
    "vllm:prefix_cache_hits": ("counter", MODEL_AND_ENGINE),
    "vllm:request_success": ("counter", MODEL_AND_ENGINE | {"finished_reason"}),
}
# vLLM's bucket edges, the largest below +Inf: a fleet of vLLM and tritonserve replicas sums buckets `by (le)`.
TOP_BUCKETS = {"vllm:time_to_first_token_seconds": 2560.0, "vllm:inter_token_latency_seconds": 80.0,
               "vllm:e2e_request_latency_seconds": 7680.0, "vllm:request_queue_time_seconds": 7680.0}
LONG = {"inputs": "A man walks into a bar", "parameters": {"max_new_tokens": 1500, "ignore_eos": True}}


@pytest.fixture(scope="module")
def service():
    with service_process(data_parallel_size=2, api_server_count=2) as service:
        yield service


def families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}


def per_engine(metrics: dict, sample: str, **labels) -> dict[str, float]:
    """{engine: value} of a sample (scrape's dict), its other labels as given."""
    return {dict(key)["engine"]: value for (name, key), value in metrics.items()
            if name == sample and labels.items() <= dict(key).items()}


def moved(before: dict, after: dict, sample: str, **labels) -> dict[str, float]:
    old = per_engine(before, sample, **labels)
    return {engine: value - old.get(engine, 0) for engine, value in per_engine(after, sample, **labels).items()}


def wait_idle(url: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = [per_engine(m, name) for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")]
        if not any(any(b.values()) for b in busy):
            return m
        assert time.monotonic() < deadline, busy
        time.sleep(0.05)


def test_every_series_with_its_type_and_labels(service):
    found = families(service.url)  # the first test: nothing served yet, yet every series is there
    model = httpx.get(f"{service.url}/v1/models").json()["data"][0]["id"]
    for name, (kind, labels) in SERIES.items():
        assert name in found, f"{name} is not exported"
        family = found[name]
        assert family.type == kind, (name, family.type)
        assert {frozenset(s.labels.keys() - {"le"}) for s in family.samples} == {frozenset(labels)}, name
        if kind == "counter":
            assert {s.name for s in family.samples} == {f"{name}_total"}, name
        if "model_name" in labels:
            assert {s.labels["model_name"] for s in family.samples} == {model}, name
        if "engine" in labels:
            assert {s.labels["engine"] for s in family.samples} == ENGINES, name
    assert {s.labels["finished_reason"] for s in found["vllm:request_success"].samples} == {"stop", "length", "abort"}
    for name, top in TOP_BUCKETS.items():
        edges = sorted({float(s.labels["le"]) for s in found[name].samples if "le" in s.labels})
        assert edges[-2:] == [top, float("inf")], name
    for s in found["vllm:cache_config_info"].samples:
        assert s.value == 1 and s.labels["block_size"] == "16" and int(s.labels["num_gpu_blocks"]) > 0, s
    # Idle: the cores' one label set, no adapter running or waiting; its value is when a core last looked.
    (lora,) = found["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": "8", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert time.time() - 900 < lora.value <= time.time()


def test_request_series_add_up_over_engines_and_front_ends(service):
    n, new_tokens = 16, 6
    before = wait_idle(service.url)

    async def one(i):
        # Prompts over four blocks go to the core their start hashes to: both cores get some. A client each: a
        # connection each, which the kernel hands to either front-end.
        text = f"{i}: " + "the words of a longer prompt " * 12
        async with httpx.AsyncClient(base_url=service.url, timeout=120) as client:
            r = await client.post("/generate", json={"inputs": text, "parameters": {
                "max_new_tokens": new_tokens, "ignore_eos": True}})
        assert r.status_code == 200, r.text

    async def run():
        await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(run())
    after = wait_idle(service.url)
    succeeded = moved(before, after, "vllm:request_success_total", finished_reason="length")
    assert sum(succeeded.values()) == n and all(succeeded[e] > 0 for e in ENGINES), succeeded
    for sample, per_request in [("vllm:e2e_request_latency_seconds_count", 1),
                                ("vllm:time_to_first_token_seconds_count", 1),
                                ("vllm:request_queue_time_seconds_count", 1),
                                ("vllm:request_decode_time_seconds_count", 1),
                                ("vllm:inter_token_latency_seconds_count", new_tokens - 1),
                                ("vllm:request_generation_tokens_sum", new_tokens),
                                ("vllm:request_max_num_generation_tokens_sum", new_tokens)]:
        assert moved(before, after, sample) == {e: per_request * succeeded[e] for e in ENGINES}, sample
    # The cores count tokens per step, the front-ends per request: the same numbers under the same engine label.
    assert moved(before, after, "vllm:generation_tokens_total") == moved(
        before, after, "vllm:request_generation_tokens_sum")
    assert moved(before, after, "vllm:prompt_tokens_total") == moved(before, after, "vllm:request_prompt_tokens_sum")
    ours = after[("llm_prompt_tokens_total", ())] - before[("llm_prompt_tokens_total", ())]
    assert sum(moved(before, after, "vllm:prompt_tokens_total").values()) == ours > 0
    assert sum(moved(before, after, "vllm:prefix_cache_queries_total").values()) > 0
    # Whichever front-end answers /metrics (a connection each) reads every process's files: the same totals.
    totals = {sum(per_engine(scrape(service.url), "vllm:request_success_total").values()) for _ in range(6)}
    assert len(totals) == 1, totals


def test_finished_reasons_and_the_load_of_a_running_request(service):
    before = wait_idle(service.url)
    # A stop string ends a request with "stop" (the front-end finds it); the model writes an "e" within 64 tokens.
    r = httpx.post(f"{service.url}/generate", timeout=120, json={"inputs": "The weather", "parameters": {
        "max_new_tokens": 64, "stop": ["e"], "ignore_eos": True, "details": True}})
    assert r.status_code == 200 and r.json()["details"]["finish_reason"] == "stop_sequence", r.text
    # A client that leaves mid-stream: an abort. While it runs, its core's gauges say so, under both names.
    with httpx.stream("POST", f"{service.url}/generate_stream", json=LONG, timeout=60) as stream:
        events = sse_events(stream)  # held: a dropped reader closes the connection
        for _ in range(5):
            next(events)
        m = scrape(service.url)
    (engine,) = [e for e, running in per_engine(m, "vllm:num_requests_running").items() if running]
    assert per_engine(m, "vllm:num_requests_running") == per_engine(m, "llm_requests_running")
    usage = per_engine(m, "vllm:kv_cache_usage_perc")
    assert 0 < usage[engine] <= 1 and usage == per_engine(m, "llm_kv_cache_usage_ratio"), usage
    after = wait_idle(service.url)
    for reason, count in [("stop", 1), ("length", 0), ("abort", 1)]:
        assert sum(moved(before, after, "vllm:request_success_total", finished_reason=reason).values()) == count, reason
    assert sum(moved(before, after, "vllm:e2e_request_latency_seconds_count").values()) == 1  # finished ones only


def lora_series(registry) -> tuple[dict, float]:
    """(labels, value) of the one vllm:lora_requests_info series that /metrics shows."""
    (family,) = [f for f in text_string_to_metric_families(exposition(registry).decode())
                 if f.name == "vllm:lora_requests_info"]
    (sample,) = family.samples
    return sample.labels, sample.value


def check_lora_series() -> None:
    """EngineMetrics.record_loras as the gateway reads it: only the current label set, valued with a recent time.
    Run in this process and, as the service runs it, in prometheus_client's multiprocess mode."""
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, 0, "base", 16, 100)
    start = time.time()
    for running, waiting in [([], []), (["a"], []), (["a", "b"], ["c"]), (["a", "b"], ["c"]), (["b"], [])]:
        metrics.record_loras(running, waiting, 8)
    labels, value = lora_series(registry)
    assert labels == {"max_lora": "8", "running_lora_adapters": "b", "waiting_lora_adapters": ""}
    assert start <= value <= time.time()


@pytest.mark.parametrize("multiprocess", [False, True])
def test_lora_requests_info_shows_only_the_current_adapters(multiprocess, tmp_path):
    if not multiprocess:
        check_lora_series()
        return
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", "import test_vllm_metrics as t; t.check_lora_series()"],
                         cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_core_names_the_adapters_of_its_running_and_waiting_requests():
    """EngineCore._record_load: the adapters of the scheduler's queues, each once, with the engine's adapter slots;
    while steps run it looks at most once a second, and at once when the engine goes idle."""
    def seqs(*adapters):
        return [SimpleNamespace(adapter=a) for a in adapters]

    registry = CollectorRegistry()
    scheduler = SimpleNamespace(running=seqs("b", None, "a", "b"), waiting=seqs("c", None))
    engine = SimpleNamespace(has_work=True, num_running=4, kv_usage=0.5, scheduler=scheduler, adapter_name=str,
                             adapter_reads=2, runner=SimpleNamespace(slots=SimpleNamespace(loads=3, evictions=1)))
    core = SimpleNamespace(engine=engine, num_waiting=2, settings=SimpleNamespace(max_loras=4), _loras_at=0.0,
                           metrics=EngineMetrics(registry, 0, "base", 16, 100))
    EngineCore._record_load(core)
    assert lora_series(registry)[0] == {"max_lora": "4", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    scheduler.running, scheduler.waiting = seqs("d"), []
    EngineCore._record_load(core)  # a step within the interval: not looked at again
    assert lora_series(registry)[0]["running_lora_adapters"] == "a,b"
    core._loras_at -= LORA_INTERVAL
    EngineCore._record_load(core)
    assert lora_series(registry)[0]["running_lora_adapters"] == "d"
    scheduler.running, core.engine.has_work = [], False
    EngineCore._record_load(core)  # idle: at once
    assert lora_series(registry)[0] == {"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}
