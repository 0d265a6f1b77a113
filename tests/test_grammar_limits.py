"""Structured outputs cannot be turned against the service: compiled grammars are bounded in memory, compiles in
time and in number (counted as waiting, dropped when their client leaves), schemas in size and to local $refs, and
a grammar that can never be matched is refused or ends its request with a clear error, never with a forced token.
Real servers, embedded model, CPU."""
import asyncio
import json
import time

import httpx
import psutil
import pytest
from schemas import DEAD_END
from server import scrape, service_process

# 60 strings of long bounded patterns: compiles for about 3 s on the CPU with the embedded model's vocabulary
# (xgrammar 0.2.9; it builds plain maxLength strings at once).
SLOW = {"type": "object", "required": [f"p{k}" for k in range(60)],
        "properties": {f"p{k}": {"type": "string", "pattern": f"[a-z ]{{1,{1000 + k}}}"} for k in range(60)}}
# An empty anyOf: no output at all matches it (xgrammar refuses a $ref cycle itself).
NOTHING = {"anyOf": []}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def complete(url: str, schema: dict, timeout: float = 120, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout, json={
        "model": "tgi", "prompt": "Give me", "max_tokens": 8, "response_format": schema_format(schema), **body})


def engine_core(service) -> psutil.Process:
    return next(p for p in psutil.Process(service.process.pid).children(recursive=True)
                if p.name() == "llm-engine-core")


@pytest.fixture(scope="module")
def service():
    with service_process(grammar_compile_timeout=1.0) as service:
        yield service


def test_a_schema_that_matches_nothing_is_refused_up_front(service):
    r = complete(service.url, NOTHING)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text
    assert "matches no output" in r.json()["error"]["message"]
    r = complete(service.url, {"$ref": "#"})
    assert r.status_code == 400 and "Circular $ref" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{service.url}/generate", timeout=60, json={"inputs": "a", "parameters": {
        "grammar": {"type": "regex", "value": "[^\\x00-\\U0010FFFF]"}}})
    assert r.status_code == 400 and "matches no output" in r.json()["error"], r.text


def test_a_grammar_at_a_dead_end_ends_its_request_with_an_error_not_a_forced_token(service):
    r = complete(service.url, DEAD_END, max_tokens=16)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_grammar" and "allows no token" in r.json()["error"]["message"]
    with httpx.stream("POST", f"{service.url}/v1/chat/completions", timeout=60, json={
            "model": "tgi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": True,
            "response_format": schema_format(DEAD_END)}) as r:
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert json.loads(events[-1])["error"]["code"] == "invalid_grammar", events
    assert "outside its grammar" not in service.log_tail(100_000)


def test_min_tokens_does_not_outlast_a_grammar_that_is_complete(service):
    r = complete(service.url, {"type": "integer", "minimum": 0, "maximum": 9}, max_tokens=16, min_tokens=10)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert 0 <= json.loads(choice["text"]) <= 9 and choice["finish_reason"] == "stop"
    assert "outside its grammar" not in service.log_tail(100_000)


@pytest.mark.parametrize("ref", ["file:///etc/passwd", "http://169.254.169.254/latest/meta-data"])
def test_an_external_ref_is_a_400(service, ref):
    r = complete(service.url, {"type": "object", "properties": {"x": {"$ref": ref}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert ref in r.json()["error"]["message"]


def test_a_schema_longer_than_max_grammar_bytes_is_a_400(service):
    huge = {"enum": [f"value number {i}" for i in range(20_000)]}  # 340 KB
    r = httpx.post(f"{service.url}/generate", timeout=60, json={"inputs": "a", "parameters": {
        "max_new_tokens": 4, "grammar": {"type": "json", "value": huge}}})
    assert r.status_code == 400 and "max_grammar_bytes" in r.json()["error"], r.text


def test_a_slow_grammar_times_out_once_and_is_refused_at_once_after_while_others_compile(service):
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            async def post(schema):
                start = time.monotonic()
                r = await client.post(f"{service.url}/v1/completions", json={
                    "model": "tgi", "prompt": "a", "max_tokens": 4, "response_format": schema_format(schema)})
                return r, time.monotonic() - start

            slow = [asyncio.ensure_future(post({**SLOW, "title": str(i)})) for i in range(2)]
            await asyncio.sleep(0.2)
            quick = await post({"type": "integer"})
            return await asyncio.gather(*slow), quick

    slow, (quick, quick_seconds) = asyncio.run(main())
    for r, _ in slow:
        assert r.status_code == 400 and "grammar_compile_timeout" in r.json()["error"]["message"], r.text
    assert quick.status_code == 200, quick.text
    assert quick_seconds < 3  # it waited for a compile thread at most one timeout (1 s)
    start = time.monotonic()
    r = complete(service.url, {**SLOW, "title": "0"})
    assert r.status_code == 400 and time.monotonic() - start < 0.5, r.text


def test_compiling_requests_are_waiting_requests_and_leave_with_their_client():
    with service_process(max_waiting_requests=6) as service:
        waiting_requests_leave_with_their_client(service)


def waiting(service) -> float:
    return scrape(service.url)[("llm_requests_waiting", (("engine", "0"),))]


def waiting_requests_leave_with_their_client(service):
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            async def post(i):
                return await client.post(f"{service.url}/v1/completions", json={
                    "model": "tgi", "prompt": "a", "max_tokens": 4,
                    "response_format": schema_format({**SLOW, "title": f"w{i}"})})

            posts = [asyncio.ensure_future(post(i)) for i in range(6)]
            deadline = time.monotonic() + 10
            while waiting(service) < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            compiling = waiting(service)
            over = await client.post(f"{service.url}/v1/completions", json={
                "model": "tgi", "prompt": "a", "max_tokens": 2, "response_format": schema_format({"type": "number"})})
            for p in posts:
                p.cancel()  # the clients leave while their grammars compile
            await asyncio.gather(*posts, return_exceptions=True)
            return compiling, over

    compiling, over = asyncio.run(main())
    assert compiling == 6
    assert over.status_code == 429, over.text  # max_waiting_requests 6, compiles included
    deadline = time.monotonic() + 5  # the four queued ones go at once; the two compiling take ~7 s each
    while waiting(service) > 0:
        assert time.monotonic() < deadline, "requests whose clients left are still waiting"
        time.sleep(0.1)


def test_a_thousand_distinct_schemas_leave_the_core_within_its_memory_bound():
    """Every schema differs (12 bounded strings: 1.7 MB compiled each, 1.7 GB for all of them had they stayed):
    the compiled grammars are evicted past grammar_cache_bytes (128 MiB by default)."""
    def schema(i: int) -> dict:
        return {"type": "object", "required": [f"k{i}_{k}" for k in range(12)],
                "properties": {f"k{i}_{k}": {"type": "string", "maxLength": 20 + k} for k in range(12)}}

    with service_process() as service:
        core = engine_core(service)
        assert complete(service.url, {"type": "integer"}).status_code == 200  # the compiler's own memory
        start = core.memory_info().rss

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                queue = asyncio.Queue()
                for i in range(1000):
                    queue.put_nowait(i)

                async def worker():
                    while not queue.empty():
                        i = queue.get_nowait()
                        r = await client.post(f"{service.url}/v1/completions", json={
                            "model": "tgi", "prompt": "a", "max_tokens": 1,
                            "response_format": schema_format(schema(i))})
                        assert r.status_code == 200, r.text

                await asyncio.gather(*(worker() for _ in range(8)))

        asyncio.run(main())
        grown = core.memory_info().rss - start
        assert grown < 300 << 20, f"the engine core grew by {grown >> 20} MiB over 1000 schemas"


@pytest.mark.parametrize("route,body,fragment", [
    ("/v1/completions", {"response_format": schema_format({"anyOf": []})}, "matches no output"),
    ("/v1/completions", {"response_format": schema_format({"oneOf": []})}, "matches no output"),
    ("/v1/completions", {"response_format": schema_format({"not": {}})}, "'not' is not supported"),
    ("/v1/completions", {"response_format": schema_format({"type": "array", "items": {"type": "integer"},
                                                           "uniqueItems": True})}, "'uniqueItems' is not supported"),
    ("/generate", {"grammar": {"type": "regex", "value": "\\ud800"}}, "surrogates"),
    ("/generate", {"grammar": {"type": "regex", "value": "[\\ud800-\\udfff]+"}}, "surrogates"),
])
def test_grammars_that_cannot_be_held_to_are_a_400_not_an_empty_or_invalid_200(service, route, body, fragment):
    if route == "/generate":
        r = httpx.post(service.url + route, timeout=60,
                       json={"inputs": "x", "parameters": {"max_new_tokens": 8, **body}})
        message = r.json()["error"]
    else:
        r = httpx.post(service.url + route, timeout=60, json={"model": "tgi", "prompt": "a", "max_tokens": 8, **body})
        message = r.json()["error"]["message"]
    assert r.status_code == 400 and fragment in message, r.text


def test_a_property_named_like_an_unsupported_keyword_is_fine(service):
    r = complete(service.url, {"type": "object", "properties": {"not": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}}, "required": ["not"]},
                 max_tokens=32)
    assert r.status_code == 200 and json.loads(r.json()["choices"][0]["text"])["not"] in range(10), r.text


def test_logit_bias_keys_are_ascii_digits(service):
    r = httpx.post(f"{service.url}/v1/completions", json={"model": "tgi", "prompt": "a", "logit_bias": {"٣": 5}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "logit_bias", r.text
