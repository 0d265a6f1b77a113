"""A property-based fuzzer (schemathesis) against the real service's own OpenAPI description: requests generated
from every route's schema, valid and invalid, must never get a 5xx, and every answer must be one the description
documents (status, media type, body shape). Bounded: a small context keeps generation short on the CPU, and few
examples per route keep the whole run near a minute.

Then the surface random bodies seldom reach (a random schema or tool seldom compiles): hand-made bodies of structured
outputs (schemas, TGI grammars), tool calls, fan-out (n, best_of, prompt lists) and logit_bias, valid and invalid,
through the same checks, and on top: a valid body gets 200 and outputs that validate, an invalid one its 4xx in
the route's error shape."""
import json
import re

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemas import DEAD_END
from schemathesis.checks import CHECKS
from schemathesis.config import SchemathesisConfig
from server import serve

CHECK_NAMES = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
               "response_schema_conformance", "negative_data_rejection"]
EXAMPLES = 40


@pytest.fixture(scope="module")
def api():
    # max_model_len 64: a generated request generates at most 63 tokens; 3 jobs at most, so fuzzed fine-tuning
    # requests stop at the limit rather than keep the engine training.
    with serve(max_model_len=64, finetune_max_jobs=3, finetune_max_files=20) as url:
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def test_the_description_covers_every_route_with_a_body(api):
    documented = {(op.path, op.method.lower()) for op in operations(api) if op.body}
    assert {("/generate", "post"), ("/generate_stream", "post"), ("/v1/completions", "post"),
            ("/v1/chat/completions", "post"), ("/v1/fine_tuning/jobs", "post"), ("/v1/files", "post")} <= documented


def test_the_generated_bodies_may_carry_the_new_surface(api):
    components = api.raw_schema["components"]["schemas"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format", "n", "logit_bias"} <= set(
        components["ChatCompletionRequest"]["properties"])
    assert {"response_format", "n", "best_of", "logit_bias"} <= set(components["CompletionRequest"]["properties"])
    assert "grammar" in components["TGIParameters"]["properties"]


def test_no_route_fails_or_answers_outside_its_description(api):
    checks = CHECKS.get_by_names(CHECK_NAMES)
    failures = []
    for operation in operations(api):
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def fuzz(case):
            case.call_and_validate(checks=checks, timeout=60)

        try:
            fuzz()
        except Exception as e:  # collect every route's failure, then report them all
            failures.append(f"{operation.method.upper()} {operation.path}: {e}"[:2000])
    assert not failures, "\n\n".join(failures)


# -- the new surface, by example ---------------------------------------------------------------------------------
# Fixed bodies, those that sample seeded: a failure reproduces. Each maps to (path, body, what the answer must be).

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {
    "nested": {"type": "object", "required": ["name", "address"], "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "required": ["city", "zip"], "properties": {
            "city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "enum": {"type": "object", "required": ["mood", "ok"], "properties": {
        "mood": {"enum": ["happy", "sad", "curious"]}, "ok": {"type": "boolean"}}},
    "pattern": {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}},
    "defs": {"type": "object", "required": ["to", "via"], "properties": {
        "to": {"$ref": "#/$defs/city"}, "via": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/city"}}},
        "$defs": {"city": {"enum": ["Paris", "Oslo"]}}},
}
CYCLE = {"$ref": "#"}  # matches no output at all: refused up front
EXTERNAL = {"type": "object", "properties": {"x": {"$ref": "https://example.com/schema.json"}}}
HUGE = {"enum": [f"value number {i}" for i in range(5000)]}  # 95 KB, over max_grammar_bytes (64 KiB)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"], "additionalProperties": False, "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
PLACE = {"type": "function", "function": {"name": "go", "parameters": {
    "type": "object", "required": ["to"], "properties": {"to": {"$ref": "#/$defs/city"}},
    "$defs": {"city": {"enum": ["Paris", "Oslo"]}}}}}
ASKED = {"properties": {"q": {"enum": ["yes", "no"]}}, "required": ["q"]}  # an object's schema without "type"
SAMPLED = {"temperature": 1.0, "seed": 7}


def tool(name: str, parameters) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def chat(**fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": "tgi", "messages": ASK, "max_tokens": 150, **fields}


def completion(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"model": "tgi", "prompt": "Data: ", "max_tokens": 150, **fields}


def tgi(grammar: dict, path: str = "/generate", **parameters) -> tuple[str, dict]:
    return path, {"inputs": "Data: ", "parameters": {"max_new_tokens": 150, "details": True, "grammar": grammar,
                                                      **parameters}}


# -- what an answer must be

def events(response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.text.splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def outputs(response) -> list[dict]:
    """Every choice of an answer, streamed or not, TGI or OpenAI: {"text", "finish", "calls": [(name, args)]}."""
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        chunks = events(response)
        assert not any("error" in c for c in chunks), chunks[-1]
        if "token" in chunks[0]:  # TGI: the last event carries the whole text
            return [{"text": chunks[-1]["generated_text"], "finish": chunks[-1]["details"]["finish_reason"],
                     "calls": []}]
        choices: dict[int, dict] = {}
        for c in chunks:
            for delta in c["choices"]:
                choice = choices.setdefault(delta["index"], {"text": "", "finish": None, "calls": []})
                content = delta.get("text") or delta.get("delta", {}).get("content")
                choice["text"] += content or ""
                choice["finish"] = delta["finish_reason"] or choice["finish"]
                for call in delta.get("delta", {}).get("tool_calls") or []:
                    if call["index"] == len(choice["calls"]):
                        choice["calls"].append((call["function"]["name"], ""))
                    name, arguments = choice["calls"][call["index"]]
                    choice["calls"][call["index"]] = (name, arguments + (call["function"].get("arguments") or ""))
        return [choices[i] for i in sorted(choices)]
    body = response.json()
    if "generated_text" in body:
        details = body["details"]
        return [{"text": body["generated_text"], "finish": details["finish_reason"], "calls": []}] + [
            {"text": s["generated_text"], "finish": s["finish_reason"], "calls": []}
            for s in details.get("best_of_sequences", [])]
    return [{"text": c["text"] if "text" in c else c["message"]["content"] or "", "finish": c["finish_reason"],
             "calls": [(t["function"]["name"], t["function"]["arguments"])
                       for t in c.get("message", {}).get("tool_calls") or []]} for c in body["choices"]]


def valid_json(schema: dict, n: int = 1):
    def check(response):
        choices = outputs(response)
        assert len(choices) == n, choices
        for c in choices:
            assert c["finish"] in ("stop", "eos_token"), c
            jsonschema.validate(json.loads(c["text"]), schema)
    return check


def matching(regex: str, n: int = 1):
    def check(response):
        choices = outputs(response)
        assert len(choices) == n and all(re.fullmatch(regex, c["text"]) for c in choices), choices
    return check


def valid_calls(tools: list[dict], n: int = 1, forced: bool = True):
    """Each call names a tool and passes it a JSON object its parameters accept; forced, every choice calls."""
    parameters = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}

    def check(response):
        choices = outputs(response)
        assert len(choices) == n, choices
        for c in choices:
            if c["calls"]:
                assert c["finish"] == "tool_calls", c
            else:
                assert not forced and c["finish"] in ("stop", "length"), c
            for name, arguments in c["calls"]:
                jsonschema.validate(json.loads(arguments), {**parameters[name], "type": "object"})
    return check


def cut_short(response):
    """A forced call cut by max_tokens comes back as written, finish_reason "length"."""
    (c,) = outputs(response)
    assert c["finish"] == "length" and (c["calls"] or c["text"]), c


def answered(n: int):
    def check(response):
        choices = outputs(response)
        assert len(choices) == n and all(c["finish"] in ("stop", "length") for c in choices), choices
    return check


def one_token_over_and_over(response):
    """A bias of +100 leaves one token to sample."""
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8 and len(set(tokens)) == 1, tokens


def error_event(response):
    """A grammar at a dead end mid-output ends its stream with an error event in the route's dialect."""
    last = events(response)[-1]
    if isinstance(last["error"], dict):
        assert last["error"]["code"] == "invalid_grammar", last
    else:
        assert last["error_type"] == "validation" and last["error"].startswith("parameters.grammar"), last


def refused(status: int, param: str | None = None) -> tuple[int, str | None]:
    """An invalid body: its status, and (OpenAI routes) the field the error names."""
    return status, param


BODIES = {
    # structured outputs
    **{f"chat {name} schema": (*chat(response_format=schema_format(s), **SAMPLED), valid_json(s))
       for name, s in SCHEMAS.items()},
    "completion nested schema, greedy": (*completion(response_format=schema_format(SCHEMAS["nested"]),
                                                     temperature=0), valid_json(SCHEMAS["nested"])),
    "completion enum schema streamed": (*completion(response_format=schema_format(SCHEMAS["enum"]), stream=True),
                                        valid_json(SCHEMAS["enum"])),
    "json_object": (*completion(response_format={"type": "json_object"}, temperature=0),
                    valid_json({"type": "object"})),
    "schema with a $ref cycle": (*completion(response_format=schema_format(CYCLE)), refused(400, "response_format")),
    "schema at a dead end": (*chat(response_format=schema_format(DEAD_END)), refused(400, "response_format")),
    "schema at a dead end streamed": (*chat(response_format=schema_format(DEAD_END), stream=True), error_event),
    "external $ref": (*completion(response_format=schema_format(EXTERNAL)), refused(400, "response_format")),
    "schema over max_grammar_bytes": (*chat(response_format=schema_format(HUGE)), refused(400, "response_format")),
    "schema of an unknown type": (*chat(response_format=schema_format({"type": "bogus"})),
                                  refused(400, "response_format")),
    "schema that no string fits": (*completion(response_format=schema_format({"type": "string", "minLength": 5,
                                                                              "maxLength": 3})),
                                   refused(400, "response_format")),
    "schema with an invalid pattern": (*chat(response_format=schema_format({"type": "string", "pattern": "(["})),
                                       refused(400, "response_format")),
    "json_schema without a schema": (*chat(response_format={"type": "json_schema"}),
                                     refused(422, "response_format.json_schema")),
    # tools
    "named tool": (*chat(tools=[WEATHER, TIME], tool_choice=named("get_time"), **SAMPLED), valid_calls([TIME])),
    "named tool streamed": (*chat(tools=[WEATHER], tool_choice=named("get_weather"), stream=True),
                            valid_calls([WEATHER])),
    "required tool": (*chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=4,
                            temperature=1.0), valid_calls([WEATHER, TIME])),
    "required tools in parallel": (*chat(tools=[WEATHER, TIME], tool_choice="required", seed=4, temperature=1.0,
                                         max_tokens=200), valid_calls([WEATHER, TIME])),
    "required tool streamed": (*chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, seed=4,
                                     stream=True), valid_calls([WEATHER])),
    "required tool with $defs": (*chat(tools=[PLACE], tool_choice="required", parallel_tool_calls=False),
                                 valid_calls([PLACE])),
    "required tool, n=2 streamed": (*chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, n=2,
                                          stream=True, **SAMPLED), valid_calls([WEATHER], n=2)),
    "named tool without parameters": (*chat(tools=[tool("ping", None)], tool_choice=named("ping")),
                                      valid_calls([tool("ping", None)])),
    "named tool whose parameters omit the type": (*chat(tools=[tool("f", ASKED)], tool_choice=named("f")),
                                                  valid_calls([tool("f", ASKED)])),
    "auto tool choice": (*chat(tools=[WEATHER, TIME], max_tokens=24, **SAMPLED),
                         valid_calls([WEATHER, TIME], forced=False)),
    "no tool choice": (*chat(tools=[WEATHER], tool_choice="none", max_tokens=8), answered(1)),
    "forced call cut by max_tokens": (*chat(tools=[WEATHER], tool_choice="required", max_tokens=4), cut_short),
    "forced call cut by max_tokens streamed": (*chat(tools=[WEATHER], tool_choice=named("get_weather"),
                                                     max_tokens=3, stream=True), cut_short),
    "non-object tool parameters": (*chat(tools=[tool("f", {"type": "integer"})]),
                                   refused(422, "tools.0.function.parameters")),
    "nullable object tool parameters": (*chat(tools=[tool("f", {"type": ["object", "null"]})]),
                                        refused(422, "tools.0.function.parameters")),
    "duplicate tool names": (*chat(tools=[WEATHER, WEATHER]), refused(422, "tools")),
    "named tool not in tools": (*chat(tools=[WEATHER], tool_choice=named("get_time")),
                                refused(422, "tool_choice.function.name")),
    "tool_choice without tools": (*chat(tool_choice="required"), refused(422, "tool_choice")),
    "tool whose parameters are a $ref cycle": (*chat(tools=[tool("loop", CYCLE)], tool_choice="required"),
                                               refused(400, "tool_choice")),
    "tool with an external $ref": (*chat(tools=[tool("f", EXTERNAL)], tool_choice=named("f")),
                                   refused(400, "tool_choice")),
    "forced tool and response_format": (*chat(tools=[WEATHER], tool_choice="required",
                                              response_format={"type": "json_object"}),
                                         refused(422, "response_format")),
    # fan-out: n, best_of, prompt lists, at and over max_request_sequences (256) and the per-field caps
    "chat n=3 with a schema": (*chat(n=3, response_format=schema_format(SCHEMAS["enum"]), **SAMPLED),
                               valid_json(SCHEMAS["enum"], n=3)),
    "2 prompts x n=2 with a schema": (*completion(prompt=["Data: ", "JSON: "], n=2, **SAMPLED,
                                                  response_format=schema_format(SCHEMAS["pattern"])),
                                      valid_json(SCHEMAS["pattern"], n=4)),
    "2 prompts x n=128, at the cap": (*completion(prompt=["a", "b"], n=128, max_tokens=1), answered(256)),
    "2 prompts x best_of=128, at the cap": (*completion(prompt=["a", "b"], best_of=128, max_tokens=1, **SAMPLED),
                                            answered(2)),
    "256 prompts, at the cap": (*completion(prompt=[f"w{i}" for i in range(256)], max_tokens=1), answered(256)),
    "best_of=4, n=2": (*completion(n=2, best_of=4, max_tokens=6, **SAMPLED), answered(2)),
    "3 prompts x n=128": (*completion(prompt=["a", "b", "c"], n=128), refused(422, "n")),
    "3 prompts x best_of=128": (*completion(prompt=["a", "b", "c"], best_of=128), refused(422, "best_of")),
    "n=129": (*completion(n=129), refused(422, "n")),
    "257 prompts": (*completion(prompt=["a"] * 257), refused(422, "prompt")),
    "best_of < n": (*completion(n=3, best_of=2), refused(422, "best_of")),
    "best_of streamed": (*completion(n=1, best_of=2, stream=True), refused(422, "best_of")),
    "over max_request_tokens": (*completion(prompt=["a", "b"], n=100, max_tokens=1500), refused(422, "max_tokens")),
    "TGI best_of=3 with a regex": (*tgi({"type": "regex", "value": "[0-9]{3}"}, best_of=3, do_sample=True, seed=5),
                                   matching("[0-9]{3}", n=3)),
    "TGI best_of=129": (*tgi({"type": "regex", "value": "a"}, best_of=129, do_sample=True),
                        refused(422, "parameters.best_of")),
    # logit_bias
    "logit_bias +100": (*completion(logit_bias={"300": 100}, max_tokens=8, logprobs=0), one_token_over_and_over),
    "logit_bias on chat": (*chat(logit_bias={"0": -100, "4095": 50.5}, max_tokens=8), answered(1)),
    "logit_bias against a schema": (*completion(logit_bias={str(t): 100 for t in range(0, 4096, 97)},
                                                response_format=schema_format(SCHEMAS["enum"])),
                                    valid_json(SCHEMAS["enum"])),
    "logit_bias -100 on every token against json_object": (
        *completion(logit_bias={str(t): -100 for t in range(4096)}, response_format={"type": "json_object"},
                    temperature=0), valid_json({"type": "object"})),
    "logit_bias out of the vocabulary": (*completion(logit_bias={"4096": 1}), refused(422, "logit_bias")),
    "logit_bias id past int32": (*chat(logit_bias={str(2**31): 1}), refused(422, "logit_bias")),
    "logit_bias negative id": (*completion(logit_bias={"-1": 1}), refused(422, "logit_bias")),
    "logit_bias over 100": (*completion(logit_bias={"5": 100.5}), refused(422, "logit_bias.5")),
    "logit_bias under -100": (*chat(logit_bias={"5": -101}), refused(422, "logit_bias.5")),
    "logit_bias not a number": (*completion(logit_bias={"5": "up"}), refused(422, "logit_bias.5")),
    # TGI grammars
    "TGI json grammar": (*tgi({"type": "json", "value": SCHEMAS["nested"]}), valid_json(SCHEMAS["nested"])),
    "TGI json grammar as text": (*tgi({"type": "json", "value": json.dumps(SCHEMAS["defs"])}, do_sample=True,
                                      seed=3), valid_json(SCHEMAS["defs"])),
    "TGI json_schema grammar streamed": (*tgi({"type": "json_schema", "value": SCHEMAS["enum"]}, "/generate_stream"),
                                         valid_json(SCHEMAS["enum"])),
    "TGI regex": (*tgi({"type": "regex", "value": r"\d{3}-\d{4}"}), matching(r"\d{3}-\d{4}")),
    "TGI regex streamed": (*tgi({"type": "regex", "value": "(yes|no), [a-z]{2,6}"}, "/generate_stream",
                                do_sample=True, seed=1), matching("(yes|no), [a-z]{2,6}")),
    "TGI invalid regex": (*tgi({"type": "regex", "value": "([a-z"}), refused(400)),
    "TGI empty-class regex": (*tgi({"type": "regex", "value": "[]"}), refused(400)),
    "TGI regex matching nothing": (*tgi({"type": "regex", "value": "[^\\x00-\\U0010FFFF]"}), refused(400)),
    "TGI regex matching nothing after a": (*tgi({"type": "regex", "value": "a[^\\s\\S]b"}), refused(400)),
    "TGI regex with a lookahead": (*tgi({"type": "regex", "value": "(?=a)b"}), refused(400)),
    "TGI json grammar not JSON": (*tgi({"type": "json", "value": "{not json"}), refused(400)),
    "TGI json grammar $ref cycle": (*tgi({"type": "json", "value": CYCLE}), refused(400)),
    "TGI json grammar external $ref": (*tgi({"type": "json", "value": EXTERNAL}), refused(400)),
    "TGI json grammar over max_grammar_bytes": (*tgi({"type": "json", "value": HUGE}), refused(400)),
    "TGI grammar at a dead end streamed": (*tgi({"type": "json", "value": DEAD_END}, "/generate_stream"),
                                           error_event),
}


def check_error(path: str, response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    if path.startswith("/v1/"):
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["param"] == param, body
    else:
        assert set(body) == {"error", "error_type"} and all(isinstance(v, str) for v in body.values()), body


@pytest.fixture(scope="module")
def surface():
    # The default context: tool definitions in the chat template and fan-out at the caps need more than 64 tokens.
    # Streams are read whole (schemathesis stops at 20 events by default): their outputs are checked too.
    with serve() as url:
        yield schemathesis.openapi.from_url(f"{url}/openapi.json",
                                            config=SchemathesisConfig.from_dict({"max-stream-events": 1000}))


def test_the_new_surface_by_example(surface):
    # negative_data_rejection judges what schemathesis generated as invalid; these bodies it did not generate
    checks = CHECKS.get_by_names([name for name in CHECK_NAMES if name != "negative_data_rejection"])
    failures = []
    for name, (path, body, expected) in BODIES.items():
        try:
            case = surface[path]["POST"].Case(body=body, media_type="application/json")
            response = case.call_and_validate(checks=checks, timeout=120)
            if callable(expected):
                assert response.status_code == 200, response.text[:500]
                expected(response)
            else:
                check_error(path, response, *expected)
        except Exception as e:  # every example's failure, reported together
            failures.append(f"{name}: {type(e).__name__}: {e}"[:2000])
    assert not failures, "\n\n".join(failures)
