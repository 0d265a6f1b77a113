"""Limits and failure handling of the HTTP service against real servers and the real engine (CPU): many
concurrent streams, client disconnects freeing the KV cache, metrics, backpressure (429), API keys, body size."""
import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
from server import scrape, serve, serve_in_process, sse_events

from service.config import Settings
from service.metrics import ENDPOINTS, FINETUNE_STATES, OUTCOMES, STEP_ADAPTERS, STEP_KINDS

METRIC_NAMES = ["llm_time_to_first_token_seconds", "llm_inter_token_latency_seconds",
                "llm_e2e_request_latency_seconds", "llm_queue_time_seconds", "llm_engine_step_seconds",
                "llm_request_prompt_tokens", "llm_request_generation_tokens"]
COUNTERS = ["llm_prompt_tokens_total", "llm_generation_tokens_total", "llm_preemptions_total",
            "llm_lora_adapter_reads_total", "llm_lora_slot_loads_total", "llm_lora_slot_evictions_total",
            "llm_prefix_cache_queried_tokens_total", "llm_prefix_cache_hit_tokens_total"]
GAUGES = ["llm_requests_running", "llm_requests_waiting", "llm_kv_cache_usage_ratio", "llm_batch_size",
          "llm_gpu_memory_allocated_bytes", "llm_gpu_memory_reserved_bytes", "llm_gpu_memory_total_bytes",
          "llm_finetune_tokens_per_second", "llm_finetune_loss"]
ENGINE_SERIES = {"llm_engine_step_seconds", "llm_preemptions_total", "llm_prefix_cache_queried_tokens_total",
                 "llm_prefix_cache_hit_tokens_total", "llm_lora_adapter_reads_total", "llm_lora_slot_loads_total",
                 "llm_lora_slot_evictions_total", *GAUGES}  # labelled with the engine core's index
CORE = (("engine", "0"),)


def step_series(name: str, kind: str, adapters: str) -> tuple:
    """The key of llm_engine_steps_total or llm_engine_step_time_seconds_total for steps of `kind` serving
    `adapters`."""
    return name, (("adapters", adapters), ("engine", "0"), ("kind", kind))


# The default model's greedy continuation of this prompt runs to the 2000-token limit without EOS (a fortune
# model that ends most texts within a few dozen tokens), so a request for it is still running when its client leaves.
LONG_PROMPT = "A man walks into a bar"


def requests_total(metrics: dict, endpoint: str, outcome: str) -> float:
    return metrics[("llm_requests_total", (("endpoint", endpoint), ("outcome", outcome)))]


def model_name(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]


def wait_idle(base_url: str, timeout: float = 10) -> dict:
    """/metrics once nothing runs, waits, or holds KV blocks."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base_url)
        idle = (m[("llm_requests_running", CORE)], m[("llm_requests_waiting", CORE)],
                m[("llm_kv_cache_usage_ratio", CORE)])
        if idle == (0, 0, 0) or time.monotonic() > deadline:
            assert idle == (0, 0, 0), f"(running, waiting, kv usage) = {idle}"
            return m
        time.sleep(0.05)


@pytest.fixture(scope="module")
def base_url():
    with serve(cpu_kv_cache_bytes=32 << 20) as url:
        yield url


def test_all_series_exported_from_start(base_url):
    m = scrape(base_url)  # the first test of the module: no request served yet
    for name in METRIC_NAMES:
        labels = CORE if name in ENGINE_SERIES else ()
        assert (f"{name}_count", labels) in m and (f"{name}_bucket", (*labels, ("le", "+Inf"))) in m, name
    for name in COUNTERS + GAUGES:
        assert (name, CORE if name in ENGINE_SERIES else ()) in m, name
    for endpoint in ENDPOINTS:
        for outcome in OUTCOMES:
            assert requests_total(m, endpoint, outcome) == 0
    for state in FINETUNE_STATES:
        assert m[("llm_finetune_jobs", (*CORE, ("state", state)))] == 0
    for kind in STEP_KINDS:
        for adapters in STEP_ADAPTERS:
            for name in ("llm_engine_steps_total", "llm_engine_step_time_seconds_total"):
                assert m[step_series(name, kind, adapters)] == 0, (name, kind, adapters)
    assert m[("llm_gpu_memory_total_bytes", CORE)] == 0  # CPU


def test_metrics_move_with_a_request(base_url):
    before = scrape(base_url)
    r = httpx.post(f"{base_url}/generate", json={"inputs": "class A:", "parameters": {"max_new_tokens": 5}})
    assert r.status_code == 200
    after = wait_idle(base_url)

    def delta(name, labels=()):
        return after[(name, labels)] - before[(name, labels)]

    assert requests_total(after, "generate", "success") - requests_total(before, "generate", "success") == 1
    assert delta("llm_generation_tokens_total") == 5 and delta("llm_prompt_tokens_total") > 0
    for name, count in [("llm_time_to_first_token_seconds", 1), ("llm_inter_token_latency_seconds", 4),
                        ("llm_e2e_request_latency_seconds", 1), ("llm_queue_time_seconds", 1),
                        ("llm_request_generation_tokens", 1)]:
        assert delta(f"{name}_count") == count, name
    assert delta("llm_engine_step_seconds_count", CORE) >= 5
    # Every step of it ran eagerly (the CPU has no graphs) with no adapter, and is counted once with its duration
    steps = {(kind, adapters): after[step_series("llm_engine_steps_total", kind, adapters)]
             - before[step_series("llm_engine_steps_total", kind, adapters)]
             for kind in STEP_KINDS for adapters in STEP_ADAPTERS}
    assert steps[("eager", "none")] == delta("llm_engine_step_seconds_count", CORE)
    assert sum(steps.values()) == steps[("eager", "none")]
    seconds = step_series("llm_engine_step_time_seconds_total", "eager", "none")
    assert abs(after[seconds] - before[seconds] - delta("llm_engine_step_seconds_sum", CORE)) < 1e-6
    assert delta("llm_prefix_cache_queried_tokens_total", CORE) > 0


def test_health_and_info(base_url):
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base_url}/info").json()["max_total_tokens"] == 2048


def test_many_concurrent_streams(base_url):
    async def tgi(client, i):
        body = {"inputs": f"def f{i}(x):", "parameters": {"max_new_tokens": 6, "do_sample": True}}
        async with client.stream("POST", "/generate_stream", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line[5:]) async for line in r.aiter_lines() if line.startswith("data:")]
        # Sampled: the model may end early with EOS (itself the last token streamed) instead of at the limit.
        details = events[-1]["details"]
        assert len(events) == details["generated_tokens"] and [e["index"] for e in events] == list(range(len(events)))
        assert (details["finish_reason"], len(events)) == ("length", 6) or (
            details["finish_reason"] == "eos_token" and len(events) <= 6 and events[-1]["token"]["special"])
        return events[-1]["generated_text"]

    async def chat(client, i):
        body = {"model": model, "messages": [{"role": "user", "content": f"task {i}"}], "max_tokens": 6,
                "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            data = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
        assert data[-1] == "[DONE]"
        finish = json.loads(data[-3])["choices"][0]["finish_reason"]
        tokens = json.loads(data[-2])["usage"]["completion_tokens"]
        assert (finish, tokens) == ("length", 6) or (finish == "stop" and 1 <= tokens <= 6)  # sampled: EOS may end it

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
            await asyncio.gather(*[tgi(client, i) for i in range(20)], *[chat(client, i) for i in range(20)])

    model = model_name(base_url)
    before = scrape(base_url)
    asyncio.run(run())
    after = wait_idle(base_url)
    for endpoint in ("generate_stream", "chat_completions"):
        assert requests_total(after, endpoint, "success") - requests_total(before, endpoint, "success") == 20


def test_disconnect_mid_stream_frees_the_cache(base_url):
    before = scrape(base_url)
    body = {"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": 2000}}
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body) as r:
        events = sse_events(r)
        next(events), next(events)
        assert scrape(base_url)[("llm_kv_cache_usage_ratio", CORE)] > 0
    # Closing the response closed the connection: the engine must drop the request at once, long before
    # its 2000 tokens could have been generated.
    after = wait_idle(base_url, timeout=3)
    aborted = requests_total(after, "generate_stream", "aborted") - requests_total(before, "generate_stream", "aborted")
    assert aborted == 1


def test_disconnect_while_waiting_for_a_whole_response(base_url):
    before = scrape(base_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/generate", json={"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": 2000}},
                   timeout=httpx.Timeout(5, read=0.5))
    after = wait_idle(base_url, timeout=3)
    assert requests_total(after, "generate", "aborted") - requests_total(before, "generate", "aborted") == 1


@pytest.mark.parametrize("path,body", [
    ("/generate_stream", {"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": 2000}}),
    ("/generate", {"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": 2000}}),
    ("/v1/completions", {"model": "dummy", "prompt": LONG_PROMPT, "max_tokens": 2000, "temperature": 0,
                         "stream": True}),
])
def test_client_gone_right_after_sending(base_url, path, body):
    """The request is admitted but the connection is already closed: it must not run to its end."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    wait_idle(base_url, timeout=3)


def test_body_size_limit(base_url):
    big = {"inputs": "a" * (1 << 20), "parameters": {"max_new_tokens": 1}}
    r = httpx.post(f"{base_url}/generate", json=big)
    assert r.status_code == 413 and r.json()["error_type"] == "validation"
    r = httpx.post(f"{base_url}/v1/completions", json={"model": "m", "prompt": "a" * (1 << 20)})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]

    # Without a Content-Length (chunked upload) the limit holds while reading.
    def chunks():
        yield b'{"inputs": "'
        for _ in range(80):
            yield b"a" * (16 << 10)
        yield b'"}'

    assert httpx.post(f"{base_url}/generate", content=chunks()).status_code == 413


def test_unknown_route_is_json(base_url):
    r = httpx.get(f"{base_url}/nope")
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"
    r = httpx.get(f"{base_url}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"


def test_backpressure_is_429():
    with serve(cpu_kv_cache_bytes=8 << 20, max_num_seqs=1, max_waiting_requests=1) as url:
        async def one(client):
            r = await client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 24}})
            return r

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return await asyncio.gather(*[one(client) for _ in range(8)])

        responses = asyncio.run(run())
        rejected = [r for r in responses if r.status_code == 429]
        assert rejected and all(r.status_code in (200, 429) for r in responses)
        assert rejected[0].json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        assert int(rejected[0].headers["retry-after"]) >= 1
        m = wait_idle(url)
        assert requests_total(m, "generate", "overloaded") == len(rejected)
        assert requests_total(m, "generate", "success") == len(responses) - len(rejected)
        r = httpx.post(f"{url}/v1/completions", json={"model": model_name(url), "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200  # the service recovered


def test_api_key():
    with serve(cpu_kv_cache_bytes=8 << 20, api_key="s3cret", api_key_routes="openai,metrics") as url:
        good = {"Authorization": "Bearer s3cret"}
        r = httpx.get(f"{url}/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=good).status_code == 200
        r = httpx.get(f"{url}/metrics")
        assert r.status_code == 401 and r.json()["error_type"] == "authentication"
        assert httpx.get(f"{url}/metrics", headers=good).status_code == 200
        # Groups not listed stay open, and so does /health.
        r = httpx.post(f"{url}/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}})
        assert r.status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="a", max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_bad_api_key_routes_setting():
    with pytest.raises(ValueError, match="unknown route groups"):
        Settings(api_key_routes="generate,everything")


@pytest.mark.parametrize("block_size", [8, 24, 512])
def test_block_size_outside_the_kernels_range_is_a_settings_error(block_size):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        Settings(block_size=block_size)


def test_empty_model_env_means_the_default_model(monkeypatch):
    monkeypatch.setenv("LLM_MODEL", "")
    assert Settings().model is None


def test_a_failing_engine_step_is_a_500_and_the_service_keeps_serving():
    body = {"inputs": "def f():", "parameters": {"max_new_tokens": 4}}
    with serve_in_process(cpu_kv_cache_bytes=16 << 20) as (url, core):
        runner = core.engine.runner
        run = runner.run

        def fail(*args):
            raise RuntimeError("injected fault")
        runner.run = fail
        try:
            plain = httpx.post(f"{url}/generate", json=body, timeout=60)
            with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as stream:
                events = [json.loads(e) for e in sse_events(stream)]
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                              json={"model": "tgi", "prompt": "def f():", "max_tokens": 4, "stream": True}) as stream:
                openai_events = list(sse_events(stream))
        finally:
            runner.run = run
        # The client learns that its step failed, not the engine's exception (the log has it)
        assert plain.status_code == 500 and "failed to compute" in plain.json()["error"]
        assert "injected fault" not in plain.text and "RuntimeError" not in plain.text
        assert events[-1]["error_type"] == "generation" and "failed to compute" in events[-1]["error"]
        assert "[DONE]" not in openai_events and json.loads(openai_events[-1])["error"]["code"] == "engine_error"
        after = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert after.status_code == 200 and after.json()["generated_text"]
        m = scrape(url)
        assert requests_total(m, "generate", "internal_error") == 1
        assert requests_total(m, "generate_stream", "internal_error") == 1
        assert m[("llm_kv_cache_usage_ratio", CORE)] == 0


def test_every_limit_is_documented_with_its_setting_in_the_readme_and_in_the_openapi_description():
    from pathlib import Path

    from service.api import create_app
    from service.api.openapi import openapi_schema
    from service.config import LIMITS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("**Limits.**"):readme.index("### Fine-tuning")]
    settings = Settings(max_request_sequences=77, grammar_compile_timeout=2.5)
    description = openapi_schema(create_app(settings, "ipc:///nowhere"))["info"]["description"]
    for name, _, _ in LIMITS:
        assert name in Settings.model_fields, name
        assert f"| `{name}` |" in table, f"{name} is missing from the README's Limits table"
        assert f"| `{name}` | {getattr(settings, name)} |" in description, name
