"""One bad request must never hurt another: attacks and odd inputs against a real server (embedded model, CPU),
each answered with a clear 4xx (or served correctly), while other requests go on unharmed."""
import asyncio
import json

import httpx
import pytest
from server import scrape, serve, sse_events

DEEP = 50_000  # nesting past any parser's recursion limit


def strict_json(text: str):
    """json.loads that refuses NaN/Infinity, which are not JSON: a response carrying them is broken."""
    def refuse(name):
        raise ValueError(f"{name} in a response")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def base_url():
    with serve(cpu_kv_cache_bytes=32 << 20) as url:
        yield url


def model_name(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]


def stream_tokens(base_url: str, client: httpx.AsyncClient, prompt: str, n: int):
    async def run():
        body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "do_sample": True, "seed": 1}}
        async with client.stream("POST", f"{base_url}/generate_stream", json=body) as r:
            assert r.status_code == 200
            return [strict_json(line[5:]) async for line in r.aiter_lines() if line.startswith("data:")]
    return run()


# -- 1: a request's sampling parameters never fail the step of others ---------------------------------------
def test_repetition_penalty_is_served_beside_unrelated_streams(base_url):
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            others = [asyncio.ensure_future(stream_tokens(base_url, client, f"Story {i}:", 24)) for i in range(3)]
            await asyncio.sleep(0.2)
            penalized = await client.post(f"{base_url}/generate", json={
                "inputs": "hi", "parameters": {"repetition_penalty": 1.1, "max_new_tokens": 8, "details": True}})
            return penalized, await asyncio.gather(*others)

    penalized, streams = asyncio.run(main())
    assert penalized.status_code == 200, penalized.text
    assert penalized.json()["details"]["generated_tokens"] >= 1
    for events in streams:
        assert "error" not in events[-1] and events[-1]["details"]["finish_reason"] in ("length", "eos_token")


def test_a_strong_repetition_penalty_changes_greedy_output(base_url):
    def greedy(penalty):
        r = httpx.post(f"{base_url}/generate", json={"inputs": "The the the the", "parameters": {
            "max_new_tokens": 12, "repetition_penalty": penalty, "details": True}}, timeout=60)
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    plain, penalized = greedy(1.0), greedy(100.0)
    assert plain != penalized
    assert len(set(penalized)) == len(penalized)  # a token once seen is never the argmax again


@pytest.mark.parametrize("route,body,field", [
    ("/generate", {"inputs": "a", "parameters": {"top_k": 2**63}}, "parameters.top_k"),
    ("/v1/completions", {"model": "tgi", "prompt": "a", "top_k": 2**63}, "top_k"),
])
def test_top_k_beyond_int64_is_a_422(base_url, route, body, field):
    r = httpx.post(base_url + route, json=body)
    assert r.status_code == 422, r.text
    message = r.json()["error"]
    assert (message["param"] if isinstance(message, dict) else message.split(":")[0]) == field


def test_a_top_k_beyond_the_vocabulary_keeps_every_token(base_url):
    r = httpx.post(f"{base_url}/generate", json={"inputs": "a", "parameters": {
        "top_k": 2**31 - 1, "max_new_tokens": 3, "seed": 3}})
    assert r.status_code == 200, r.text


# -- 2: tiny temperatures are greedy, never NaN ------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-7])
def test_tiny_temperatures_are_greedy_with_finite_logprobs(base_url, temperature):
    def run(params):
        body = {"inputs": "Never trust a", "parameters": {"max_new_tokens": 6, "details": True, **params}}
        r = httpx.post(f"{base_url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return strict_json(r.text)

    greedy, tiny = run({}), run({"temperature": temperature, "do_sample": True})
    assert [t["id"] for t in tiny["details"]["tokens"]] == [t["id"] for t in greedy["details"]["tokens"]]
    with httpx.stream("POST", f"{base_url}/generate_stream", json={
            "inputs": "Never trust a", "parameters": {"max_new_tokens": 6, "temperature": temperature}}) as r:
        events = [strict_json(e) for e in sse_events(r)]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in greedy["details"]["tokens"]]
    r = httpx.post(f"{base_url}/v1/chat/completions", json={
        "model": model_name(base_url), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "temperature": temperature, "logprobs": True, "top_logprobs": 5, "top_k": 1})
    assert r.status_code == 200
    for entry in strict_json(r.text)["choices"][0]["logprobs"]["content"]:  # top-k masked tokens: finite floor
        assert all(-1e4 <= t["logprob"] <= 0 for t in entry["top_logprobs"])


# -- 3: text that is not text is a 400, and the connection stays usable ---------------------------------
SURROGATE = '"\\ud800"'


@pytest.mark.parametrize("route,raw", [
    ("/v1/completions", '{"model": "tgi", "prompt": %s, "max_tokens": 2}' % SURROGATE),
    ("/v1/chat/completions", '{"model": "tgi", "messages": [{"role": "user", "content": %s}]}' % SURROGATE),
    ("/v1/chat/completions", '{"model": %s, "messages": [{"role": "user", "content": "hi"}]}' % SURROGATE),
    ("/generate", '{"inputs": %s}' % SURROGATE),
    ("/generate", '{"inputs": "a", "parameters": {"stop": [%s]}}' % SURROGATE),
])
def test_lone_surrogates_are_a_400_on_a_connection_that_stays_open(base_url, route, raw):
    with httpx.Client(base_url=base_url, timeout=30) as client:
        r = client.post(route, content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        message = r.json()["error"]
        assert "surrogate" in (message["message"] if isinstance(message, dict) else message)
        # the same pooled connection serves the next request
        assert client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}}).status_code == 200
        assert client.get("/health").status_code == 200


def _upload(base_url: str, data: bytes) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/files", files={"file": ("t.jsonl", data)}, data={"purpose": "fine-tune"})


@pytest.mark.parametrize("data,needle", [
    (b'{"text": "\\ud800 abc"}\n', "surrogate"),
    (b'{"text": "a"}\n' + b"[" * DEEP + b"]" * DEEP + b"\n", "nested too deeply"),
    (b'{"prompt": "' + b"[" * DEEP + b'", "completion": "x"}\n', None),  # deep-looking but a plain string: fine
])
def test_training_files_that_are_not_text_are_refused_at_upload(base_url, data, needle):
    r = _upload(base_url, data)
    if needle is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_a_surrogate_in_job_metadata_is_a_400_and_creates_no_job(base_url):
    upload = _upload(base_url, b'{"prompt": "a", "completion": "b"}\n').json()
    raw = ('{"model": "%s", "training_file": "%s", "metadata": {"k": %s}}'
           % (model_name(base_url), upload["id"], SURROGATE))
    before = httpx.get(f"{base_url}/v1/fine_tuning/jobs").json()["data"]
    r = httpx.post(f"{base_url}/v1/fine_tuning/jobs", content=raw.encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    after = httpx.get(f"{base_url}/v1/fine_tuning/jobs")
    assert after.status_code == 200 and after.json()["data"] == before


def test_nothing_is_left_running(base_url):
    m = scrape(base_url)
    assert (m[("llm_requests_running", ())], m[("llm_kv_cache_usage_ratio", ())]) == (0, 0)
    assert sum(v for (name, labels), v in m.items()
               if name == "llm_requests_total" and ("outcome", "internal_error") in labels) == 0
