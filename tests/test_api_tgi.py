"""The text-generation-inference API against a real server and engine (embedded default model, CPU):
huggingface_hub's InferenceClient unchanged, raw SSE, TGI sampling semantics, and every validation error."""
import json

import httpx
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError as HFValidationError
from server import scrape, serve, sse_events

PROMPT = "def parse(text):"


@pytest.fixture(scope="module")
def base_url():
    with serve(cpu_kv_cache_bytes=16 << 20, max_stop_sequences=4) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return InferenceClient(base_url=base_url)


def test_text_generation_plain_and_details(client):
    text = client.text_generation(PROMPT, max_new_tokens=6)
    assert isinstance(text, str) and text
    out = client.text_generation(PROMPT, max_new_tokens=6, details=True)
    assert out.generated_text == text  # greedy: do_sample defaults to false
    d = out.details
    assert d.finish_reason == "length" and d.generated_tokens == 6 and len(d.tokens) == 6 and d.seed is None
    assert "".join(t.text for t in d.tokens) == text
    assert all(t.logprob is not None and t.logprob <= 0 and t.special is False for t in d.tokens)


def test_text_generation_stream(client):
    full = client.text_generation(PROMPT, max_new_tokens=5)
    pieces = list(client.text_generation(PROMPT, max_new_tokens=5, stream=True))
    assert len(pieces) == 5 and "".join(pieces) == full
    events = list(client.text_generation(PROMPT, max_new_tokens=5, stream=True, details=True))
    assert [e.generated_text for e in events[:-1]] == [None] * 4 and events[-1].generated_text == full
    assert events[-1].details.finish_reason == "length" and events[-1].details.generated_tokens == 5
    assert all(e.details is None for e in events[:-1])


def test_sampling_reports_a_seed_that_reproduces_it(client):
    first = client.text_generation(PROMPT, max_new_tokens=8, do_sample=True, details=True)
    assert isinstance(first.details.seed, int)
    again = client.text_generation(PROMPT, max_new_tokens=8, do_sample=True, seed=first.details.seed, details=True)
    assert again.generated_text == first.generated_text
    # As TGI: setting a warper (temperature) turns sampling on even without do_sample.
    warped = client.text_generation(PROMPT, max_new_tokens=8, temperature=0.7, details=True)
    assert warped.details.seed is not None


def test_return_full_text_and_stop(client):
    text = client.text_generation(PROMPT, max_new_tokens=6)
    assert client.text_generation(PROMPT, max_new_tokens=6, return_full_text=True) == PROMPT + text
    stop = text[len(text) // 2:][:3]
    out = client.text_generation(PROMPT, max_new_tokens=6, stop=[stop], details=True)
    assert out.details.finish_reason == "stop_sequence"
    assert out.generated_text == text[:text.index(stop) + len(stop)]  # as TGI: the stop sequence is returned


def test_decoder_input_details_lists_the_prompt(client):
    out = client.text_generation(PROMPT, max_new_tokens=2, details=True, decoder_input_details=True)
    assert "".join(t.text for t in out.details.prefill) == PROMPT


def test_raw_routes_and_request_id(base_url):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    r = httpx.post(f"{base_url}/generate", json=body, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    assert set(r.json()) == {"generated_text"}
    assert len(httpx.post(f"{base_url}/generate", json=body).headers["x-request-id"]) == 32  # generated
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(e) for e in sse_events(r)]
    assert len(events) == 3 and [e["index"] for e in events] == [0, 1, 2]
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert events[-1]["details"]["finish_reason"] == "length" and events[-1]["details"]["generated_tokens"] == 3


def test_client_error_types(client):
    with pytest.raises(HFValidationError, match="temperature"):
        client.text_generation(PROMPT, max_new_tokens=2, temperature=0.0)


LONG = "x = 1\n" * 2000  # well over the 2048-token context

BAD_REQUESTS = [
    ({"inputs": ""}, "inputs"),
    ({"parameters": {"max_new_tokens": 2}}, "inputs"),
    ({"inputs": 7}, "inputs"),
    ({"inputs": "a", "parameters": {"temperature": -1}}, "parameters.temperature"),
    ({"inputs": "a", "parameters": {"temperature": 0}}, "parameters.temperature"),
    ({"inputs": "a", "parameters": {"top_p": 0}}, "parameters.top_p"),
    ({"inputs": "a", "parameters": {"top_p": 1.5}}, "parameters.top_p"),
    ({"inputs": "a", "parameters": {"top_k": 0}}, "parameters.top_k"),
    ({"inputs": "a", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"max_new_tokens": "ten"}}, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"repetition_penalty": 0}}, "parameters.repetition_penalty"),
    ({"inputs": "a", "parameters": {"seed": -1}}, "parameters.seed"),
    ({"inputs": "a", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}, "parameters.stop"),
    ({"inputs": "a", "parameters": {"stop": [""]}}, "parameters.stop"),
    ({"inputs": "a", "parameters": {"best_of": 2}}, "parameters.best_of"),  # greedy
    ({"inputs": "a", "parameters": {"best_of": 0}}, "parameters.best_of"),
    ({"inputs": "a", "parameters": {"grammar": {"type": "regex", "value": {"a": 1}}}}, "parameters.grammar.value"),
    ({"inputs": "a", "parameters": {"grammar": {"type": "xml", "value": "a"}}}, "parameters.grammar.type"),
    ({"inputs": "a", "parameters": {"frequency_penalty": 2.5}}, "parameters.frequency_penalty"),
    ({"inputs": "a", "parameters": {"max_tokens": 5}}, "parameters.max_tokens"),
    ({"inputs": "a", "parameters": {"adapter_id": "no-such-adapter"}}, "parameters.adapter_id"),
    ({"inputs": "a", "parameters": {"max_new_tokens": 4096}}, "parameters.max_new_tokens"),
    ({"inputs": LONG, "parameters": {"max_new_tokens": 2}}, "inputs"),
    ([1, 2], None),
]


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
def test_validation_errors(base_url, route):
    before = scrape(base_url)
    endpoint = route.strip("/")
    for body, field in BAD_REQUESTS:
        r = httpx.post(base_url + route, json=body)
        assert r.status_code == 422, (body, r.text)
        error = r.json()
        assert set(error) == {"error", "error_type"} and error["error_type"] == "validation", error
        if field is not None:
            assert error["error"].startswith(field + ":"), (field, error)
    raw = [(b'{"inputs": "a", "parameters": {"temperature": NaN}}', 422, "parameters.temperature"),
           (b'{"inputs": "a", "parameters": {"top_p": Infinity}}', 422, "parameters.top_p"),
           (b'{"inputs": "a"', 400, "JSON"),
           (b"inputs=a", 400, "JSON"),
           (b'{"inputs": "\xff\xfe"}', 400, "UTF-8")]
    for content, status, needle in raw:
        r = httpx.post(base_url + route, content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        assert r.json()["error_type"] == "validation" and needle in r.json()["error"], r.text
    after = scrape(base_url)
    key = ("llm_requests_total", (("endpoint", endpoint), ("outcome", "validation_error")))
    assert after[key] - before[key] == len(BAD_REQUESTS) + len(raw)
    # Nothing reached the engine, which still serves.
    assert after[("llm_requests_running", (("engine", "0"),))] == 0
    assert httpx.post(base_url + route, json={"inputs": "a", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_compat_root_route_counts_by_stream_flag(base_url):
    before = scrape(base_url)
    assert httpx.post(base_url, json={"inputs": "a", "parameters": {"max_new_tokens": 2}}).status_code == 200
    with httpx.stream("POST", base_url, json={"inputs": "a", "stream": True, "parameters": {"max_new_tokens": 2}}) as r:
        assert len(list(sse_events(r))) == 2
    after = scrape(base_url)
    for endpoint in ("generate", "generate_stream"):
        key = ("llm_requests_total", (("endpoint", endpoint), ("outcome", "success")))
        assert after[key] - before[key] == 1
