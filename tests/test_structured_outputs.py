"""What OpenAI and TGI clients send beyond plain generation, against real servers (CPU): structured outputs
(response_format, TGI grammars) that validate with `jsonschema` on the embedded model and on a random one, tool
calling (forced and parsed, streamed and not), n completions and batched prompts, TGI best_of; through the
official openai client and huggingface_hub."""
import json
import re
import threading
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from server import serve
from tiny_models import make_tiny_model

from service.api.engine_client import RequestStream
from service.protocol import RequestOutput
from service.text import TextStream, load_tokenizer

SCHEMAS = {
    "nested": {"type": "object", "required": ["name", "address"], "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "required": ["city", "zip"], "properties": {
            "city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "array": {"type": "object", "required": ["items"], "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 4,
                  "items": {"type": "object", "required": ["sku", "count"], "properties": {
                      "sku": {"type": "string", "maxLength": 8}, "count": {"type": "integer", "minimum": 1,
                                                                          "maximum": 99}}}}}},
    "enum": {"type": "object", "required": ["mood", "ok"], "properties": {
        "mood": {"enum": ["happy", "sad", "curious"]}, "ok": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 10}}},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "additionalProperties": False, "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"], "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url():
    with serve(cpu_kv_cache_bytes=16 << 20, served_model_name="tiny") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def random_client(tmp_path_factory):
    path = make_tiny_model("qwen2", tmp_path_factory.mktemp("random-qwen2"))
    with serve(model=str(path), served_model_name="random", dtype="float32") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _json_schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_validate_on_the_embedded_and_a_random_model(client, random_client, name):
    for c, model in ((client, "tiny"), (random_client, "random")):
        for temperature in (0.0, 1.0):
            out = c.chat.completions.create(model=model, messages=ASK, response_format=_json_schema(name),
                                            max_tokens=200, temperature=temperature, seed=3)
            choice = out.choices[0]
            assert choice.finish_reason == "stop", (model, choice)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    stream = client.chat.completions.create(model="tiny", messages=ASK, response_format=_json_schema(name),
                                            max_tokens=200, stream=True)
    chunks = list(stream)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), SCHEMAS[name])
    assert chunks[-1].choices[0].finish_reason == "stop"
    completion = client.completions.create(model="tiny", prompt="Data: ", max_tokens=200, temperature=0,
                                           extra_body={"response_format": _json_schema(name)})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS[name])


def test_json_object_is_a_json_object(client):
    out = client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=300, temperature=0)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_a_bad_schema_is_400_naming_the_field_and_harms_no_one(base_url, client):
    """A schema that does not compile is refused while another request streams beside it, untouched."""
    result = {}

    def stream_beside():
        chunks = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}))
        result["tokens"] = chunks[-1].usage.completion_tokens
        result["finish"] = chunks[-2].choices[0].finish_reason

    beside = threading.Thread(target=stream_beside)
    beside.start()
    bad = [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}, "response_format"),
           ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}, "response_format")]
    for response_format, param in bad:
        r = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "tiny", "messages": ASK,
                                                               "response_format": response_format})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == "invalid_grammar" and error["message"].startswith(param)
    r = httpx.post(f"{base_url}/generate", json={"inputs": "a", "parameters": {
        "grammar": {"type": "regex", "value": "([a-z"}}})
    assert r.status_code == 400 and "parameters.grammar" in r.json()["error"], r.text
    beside.join()
    assert result == {"tokens": 40, "finish": "length"}


def _arguments(call, tool) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_a_named_tool_choice_returns_valid_arguments(client):
    for model_client, model in ((client, "tiny"),):
        out = model_client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=100, temperature=1.0, seed=2,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_time" and call.id.startswith("call_")
        assert re.fullmatch("[A-Z]{3}", _arguments(call, TIME)["zone"])
    chunks = list(client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=100, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2  # arguments stream
    assert {d.index for d in deltas} == {0}
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_choice_calls_a_tool_streamed_or_not(client):
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for parallel in (False, True):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=list(tools.values()),
                                             tool_choice="required", parallel_tool_calls=parallel, max_tokens=200,
                                             temperature=1.0, seed=4)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
        for call in calls:
            _arguments(call, tools[call.function.name])
    # One call, seeded: unseeded sampling of an unbounded array of calls can run past max_tokens (no calls then).
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], stream=True,
                                                 tool_choice="required", parallel_tool_calls=False, seed=4,
                                                 max_tokens=200))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    # The call opens with its name, then its arguments stream as they are written.
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2
    assert {d.index for d in deltas} == {0} and all(d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_calls_cut_short_come_back_as_generated_with_finish_reason_length(client, base_url):
    """A forced call that max_tokens cuts short keeps what it wrote (named: the arguments so far; "required": the
    calls whose name was written, the last with its arguments so far), streamed as it is written, and says
    "length", never "tool_calls"."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=named, max_tokens=1)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls[0].function.name == "get_weather"
    assert choice.message.tool_calls[0].function.arguments == "{"
    for stream in (False, True):
        for max_tokens in (4, 40):
            r = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                "max_tokens": max_tokens, "stream": stream, "seed": 4, "temperature": 1.0})
            assert r.status_code == 200, r.text
            if stream:
                chunks = [json.loads(line[5:]) for line in r.text.splitlines()
                          if line.startswith("data:") and line[5:].strip() != "[DONE]"]
                deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
                content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
                text = (deltas[0]["function"]["name"] + "".join(d["function"]["arguments"] for d in deltas)
                        if deltas else content)
                finish = chunks[-1]["choices"][0]["finish_reason"]
            else:
                message = r.json()["choices"][0]["message"]
                calls, content = message.get("tool_calls") or [], message["content"]
                text = calls[0]["function"]["name"] + calls[0]["function"]["arguments"] if calls else content
                finish = r.json()["choices"][0]["finish_reason"]
            assert finish == "length" and text, r.text  # nothing generated is dropped
            if max_tokens == 40:  # long enough to have written the call's name
                assert text.startswith("get_weather"), text


def test_a_tools_parameters_must_be_an_object_and_may_refer_to_its_own_defs(client, base_url):
    integer = {"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, "tools": [integer]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "tools.0.function.parameters", r.text
    # $defs of a tool's parameters resolve inside the "required" array of calls, and a tool that can never be
    # called (its parameters a $ref to itself) is a 400, not an empty reply.
    place = {"type": "function", "function": {"name": "go", "parameters": {
        "type": "object", "required": ["to"], "properties": {"to": {"$ref": "#/$defs/city"}},
        "$defs": {"city": {"enum": ["Paris", "Oslo"]}}}}}
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=[place], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=100)
    assert out.choices[0].finish_reason == "tool_calls"
    assert json.loads(out.choices[0].message.tool_calls[0].function.arguments)["to"] in ("Paris", "Oslo")
    cycle = {"type": "function", "function": {"name": "loop", "parameters": {"$ref": "#"}}}
    for choice in ("required", {"type": "function", "function": {"name": "loop"}}):
        r = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": ASK, "tools": [cycle], "tool_choice": choice, "max_tokens": 30})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text


def test_tool_history_and_none_and_auto_without_a_call(client):
    """Assistant tool calls and tool answers in the history render through the template; with "none" (or a
    model that answers in text under "auto") the reply is content."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    for tool_choice in ("none", "auto"):
        out = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=8,
                                             temperature=0, tool_choice=tool_choice)
        choice = out.choices[0]
        assert choice.message.content and not choice.message.tool_calls and choice.finish_reason == "length"
    prompt = httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                        json={"messages": history, "return_token_strs": True}).json()
    assert prompt["count"] > 20


def test_n_completions_and_batched_prompts(client):
    greedy = client.chat.completions.create(model="tiny", messages=ASK, n=3, max_tokens=8, temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1 and greedy.usage.completion_tokens == 24
    sampled = client.chat.completions.create(model="tiny", messages=ASK, n=3, max_tokens=12, temperature=1.0,
                                             seed=9, extra_body={"ignore_eos": True})
    assert len({c.message.content for c in sampled.choices}) == 3
    again = client.chat.completions.create(model="tiny", messages=ASK, n=3, max_tokens=12, temperature=1.0,
                                           seed=9, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in sampled.choices]
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, n=3, max_tokens=12, temperature=1.0,
                                                 seed=9, stream=True, extra_body={"ignore_eos": True}))
    texts = ["", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in sampled.choices]
    batch = client.completions.create(model="tiny", prompt=["import os\n", "def main():\n"], n=2, max_tokens=6,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in ("import os\n", "def main():\n")]
    assert [c.text for c in batch.choices] == [alone[0], alone[0], alone[1], alone[1]]
    best = client.completions.create(model="tiny", prompt="import os\n", n=2, best_of=4, max_tokens=6,
                                     temperature=1.0, seed=1, logprobs=1)
    totals = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert len(best.choices) == 2 and totals[0] >= totals[1]


def test_tokens_that_arrive_before_their_completion_is_numbered_take_its_number():
    """A request of several prompts is taken over only once all are admitted: the first prompt's first tokens may
    arrive before its streams learn their choice (seen under load: a fork's first token went to choice 0)."""
    tokenizer = load_tokenizer(Path(__file__).parents[1] / "service" / "default_model")
    stream = RequestStream("r#1", TextStream(tokenizer, [5, 6], [], False), set())
    stream.push(RequestOutput("r#1", 201))
    stream.choice = 3
    stream.push(RequestOutput("r#1", 319))
    assert [(out.choice, out.index) for out in stream.take()] == [(3, 0), (3, 1)]


def test_huggingface_hub_grammar_tools_and_best_of(base_url):
    hub = InferenceClient(base_url=base_url)
    text = hub.text_generation("Data: ", max_new_tokens=200, grammar={"type": "json", "value": SCHEMAS["enum"]})
    jsonschema.validate(json.loads(text), SCHEMAS["enum"])
    text = hub.text_generation("Call ", max_new_tokens=20, grammar={"type": "regex", "value": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", text), text
    out = hub.chat_completion(ASK, tools=[WEATHER], max_tokens=100,
                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    arguments = call.function.arguments
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments,
                        WEATHER["function"]["parameters"])
    details = hub.text_generation("import os\n", max_new_tokens=5, best_of=3, do_sample=True, seed=4,
                                  details=True).details
    others = details.best_of_sequences
    assert len(others) == 2 and {s.seed for s in others} | {details.seed} == {4, 5, 6}
    total = sum(t.logprob for t in details.tokens)
    assert all(total >= sum(t.logprob for t in s.tokens) for s in others)
