"""POST /v1/responses (stateless) against a real server (embedded model, CPU) through the official openai client,
streamed and not: text or message input with instructions, structured output, function tools (required and named)
and their outputs sent back, a length cut, a grammar's dead end mid-stream, and every refusal in OpenAI's error
shape."""
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from schemas import DEAD_END
from server import serve

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "required": ["city", "unit"], "additionalProperties": False, "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
PERSON = {"type": "object", "required": ["name", "age"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url():
    with serve(cpu_kv_cache_bytes=16 << 20, served_model_name="tiny") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def streamed(client, **body):
    """(the events, the response the last one carries) of a streamed create, checking what every stream holds:
    numbered in order, opened by created and in_progress, every item added before its deltas and done after."""
    events = list(client.responses.create(stream=True, **body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert events[-1].type == {"completed": "response.completed", "incomplete": "response.incomplete"}[final.status]
    added, done = [], []
    for e in events:
        if e.type == "response.output_item.added":
            added.append(e.output_index)
        elif e.type == "response.output_item.done":
            done.append(e.output_index)
            assert e.item == final.output[e.output_index]
        elif e.type.endswith(".delta"):
            assert e.output_index in added and e.output_index not in done
            assert e.item_id == final.output[e.output_index].id
    assert added == done == list(range(len(final.output)))
    return events, final


def test_text_input_streamed_and_not_and_cut_by_max_output_tokens(client):
    out = client.responses.create(model="tiny", input="Name a colour.", max_output_tokens=6, temperature=0)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == "tiny"
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert out.output_text and message.content[0].type == "output_text"
    assert out.usage.output_tokens == 6 and out.usage.total_tokens == out.usage.input_tokens + 6
    events, final = streamed(client, model="tiny", input="Name a colour.", max_output_tokens=6, temperature=0)
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == out.output_text  # greedy is deterministic
    assert final.usage.output_tokens == 6 and final.incomplete_details.reason == "max_output_tokens"


def test_message_input_with_instructions_streamed_and_not(client):
    plain = client.responses.create(model="tiny", input=ASK, max_output_tokens=4, temperature=0)
    out = client.responses.create(model="tiny", input=ASK, instructions="Answer in French.", max_output_tokens=4,
                                  temperature=0)
    assert out.instructions == "Answer in French." and out.usage.input_tokens > plain.usage.input_tokens
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "What is the weather "},
                                          {"type": "input_text", "text": "in Paris?"}]}]
    same = client.responses.create(model="tiny", input=parts, instructions="Answer in French.", max_output_tokens=4,
                                   temperature=0)
    assert same.output_text == out.output_text and same.usage.input_tokens == out.usage.input_tokens
    _, final = streamed(client, model="tiny", input=ASK, instructions="Answer in French.", max_output_tokens=4,
                        temperature=0)
    assert final.output_text == out.output_text and final.instructions == "Answer in French."


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


def test_json_schema_output_validates_streamed_and_not(client):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    out = client.responses.create(model="tiny", input="Describe a person.", text=text, temperature=0)
    assert out.status == "completed" and out.text.format.type == "json_schema"
    jsonschema.validate(json.loads(out.output_text), PERSON)
    events, final = streamed(client, model="tiny", input="Describe a person.", text=text, temperature=0.8)
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), PERSON)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == final.output_text
    # The client's own structured outputs: a pydantic model as a strict schema, parsed back.
    parsed = client.responses.parse(model="tiny", input="Describe a person.", text_format=Person).output_parsed
    assert isinstance(parsed, Person)


def _check_call(item, name: str | None = None) -> dict:
    assert item.type == "function_call" and item.call_id.startswith("call_") and item.status == "completed"
    assert name is None or item.name == name
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, TOOLS[item.name]["parameters"])
    return arguments


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}])
def test_a_forced_function_call_validates_streamed_and_not(client, tool_choice):
    body = {"model": "tiny", "input": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice,
            "parallel_tool_calls": False, "temperature": 0}
    name = None if tool_choice == "required" else "get_time"
    out = client.responses.create(**body)
    assert out.status == "completed" and (out.tool_choice == "required" or out.tool_choice.name == "get_time")
    (call,) = out.output
    _check_call(call, name)
    events, final = streamed(client, **body)
    (call,) = final.output
    _check_call(call, name)
    assert [e.type for e in events[2:]] == ["response.output_item.added", *["response.function_call_arguments.delta"]
                                            * (len(events) - 6), "response.function_call_arguments.done",
                                            "response.output_item.done", "response.completed"]
    assert events[2].item.name == call.name and events[2].item.arguments == ""  # the name comes first
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 2 and "".join(deltas) == events[-3].arguments == call.arguments  # arguments stream


def test_function_call_outputs_in_input_render_as_tool_turns(client, base_url):
    """Calls sent back (as the client returns them, or written by hand) with their outputs render as the chat
    template renders an assistant's tool calls, consecutive calls in one turn, and the tools' answers."""
    first = client.responses.create(model="tiny", input=ASK, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0)
    assert first.status == "completed"
    calls = [*first.output, {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                             "arguments": '{"city": "Oslo", "unit": "celsius"}'}]
    answers = {first.output[0].call_id: "18 degrees", "call_2": "9 degrees"}
    conversation = [*ASK, *calls, *[{"type": "function_call_output", "call_id": call_id, "output": answer}
                                    for call_id, answer in answers.items()]]
    out = client.responses.create(model="tiny", input=conversation, tools=[WEATHER], tool_choice="none",
                                  max_output_tokens=4, temperature=0)
    assert out.output[0].type == "message" and out.output_text
    chat_calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for c in first.output] + [{"id": "call_2", "type": "function", "function": {
                      "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]
    chat = [*ASK, {"role": "assistant", "content": None, "tool_calls": chat_calls},
            *[{"role": "tool", "tool_call_id": call_id, "content": answer} for call_id, answer in answers.items()]]
    tokenized = httpx.post(f"{base_url}/tokenize", json={"messages": chat}).json()
    assert out.usage.input_tokens == tokenized["count"]  # "none": the tools are not rendered
    _, final = streamed(client, model="tiny", input=conversation, max_output_tokens=4, temperature=0)
    assert final.output_text == out.output_text


def test_a_forced_call_cut_short_is_incomplete(client):
    body = {"model": "tiny", "input": ASK, "tools": [WEATHER], "max_output_tokens": 3,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    out = client.responses.create(**body)
    (call,) = out.output
    assert out.status == "incomplete" and call.status == "incomplete" and call.name == "get_weather"
    _, final = streamed(client, **body)
    assert final.status == "incomplete" and final.output[0].status == "incomplete"


def test_a_grammar_dead_end_is_a_400_or_an_error_event(client):
    text = {"format": {"type": "json_schema", "name": "dead", "schema": DEAD_END}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", text=text, max_output_tokens=30)
    assert e.value.body["code"] == "invalid_grammar" and e.value.body["param"] == "text.format"
    events = list(client.responses.create(model="tiny", input="x", text=text, max_output_tokens=30, stream=True))
    error, failed = events[-2:]
    assert error.type == "error" and error.code == "invalid_grammar" and error.param == "text.format"
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "invalid_grammar"
    assert [e.sequence_number for e in events] == list(range(len(events)))


BAD = [
    ({"store": True}, 400, "store"),
    ({"background": True}, 400, "background"),
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"bogus": 1}, 422, "bogus"),
    ({"priority": 3}, 400, "priority"),  # read, and refused under the default fcfs policy as on the other routes
    ({"input": []}, 422, "input"),
    ({"input": 5}, 422, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 422, "input.0"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 422, "input.0.message.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 422,
     "input.0.message.content.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 422, "input.0.function_call_output.call_id"),
    ({"input": "x = 1\n" * 2000}, 422, "input"),
    ({"max_output_tokens": 0}, 422, "max_output_tokens"),
    ({"max_output_tokens": 4096}, 422, "max_output_tokens"),
    ({"temperature": 2.5}, 422, "temperature"),
    ({"top_p": 0}, 422, "top_p"),
    ({"tools": [{"type": "web_search"}]}, 422, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "has space"}]}, 422, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "integer"}}]}, 422, "tools.0.parameters"),
    ({"tools": [WEATHER, WEATHER]}, 422, "tools"),
    ({"tool_choice": "required"}, 422, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 422, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, 422, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": PERSON}}}, 422, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "s", "schema": {"$ref": "#"}}}}, 400, "text.format"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"$ref": "#"}}], "tool_choice": "required",
      "max_output_tokens": 30}, 400, "tool_choice"),  # its dead end, a few tokens in
]


def test_bad_requests_get_openai_errors(base_url, client):
    valid = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    for change, status, param in BAD:
        r = httpx.post(f"{base_url}/v1/responses", json={**valid, **change}, timeout=60)
        assert r.status_code == status, (change, r.text)
        assert set(r.json()) == {"error"}, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (change, error)
        assert error["message"].startswith(param), error
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-4o", input="hi")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:  # the client sends store: true when asked to
        client.responses.create(model="tiny", input="hi", store=True)
    assert "keeps no responses" in e.value.body["message"]
    assert httpx.post(f"{base_url}/v1/responses", json=valid).status_code == 200
    assert httpx.post(f"{base_url}/v1/responses", json={**valid, "priority": 0}).status_code == 200
