"""OpenAI's Responses API, stateless: POST /v1/responses, streamed or not.

A request is a chat completion in another shape: its instructions and input items become chat messages (function
calls join the assistant turn before them, their outputs become tool turns), its flat function tools chat tools,
and `text.format` a response_format. The chat route's pieces then render, constrain, submit and parse it
(service.api.openai_routes), and the reply comes back as output items (a message, function calls), or as the
typed, numbered events the openai client reads. Nothing is kept between requests, so what would need a stored
response (`store: true`, `background`, `previous_response_id`) is refused, saying so."""
import secrets

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from service.api.auth import require_api_key
from service.api.body import read_json
from service.api.engine_client import EngineStepError, TokenOutput
from service.api.errors import APIError
from service.api.generation import EventStream, engine, json_bytes, sse
from service.api.openai_routes import (
    FINISH_REASONS,
    _Call,
    _chat_prompt,
    _reply,
    _tool_choice,
    response_format_grammar,
    stream_error,
)
from service.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionChoice,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ResponsesRequest,
    Tool,
    ToolCall,
)
from service.api.tools import CallStream, ForcedCalls, forced_grammar, tool_format

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key("openai"))])


def _check_stateless(req: ResponsesRequest) -> None:
    unsupported = {"store": "this server keeps no responses; send store: false or leave it out",
                   "background": "responses are answered while the request waits; stream them instead",
                   "previous_response_id": "this server keeps no responses; send the whole conversation in input"}
    for field, why in unsupported.items():
        if getattr(req, field):
            raise APIError(400, f"{field}: {why}", param=field, code="unsupported_value")


def _text(parts) -> str:
    return "".join(part.text for part in parts)


def _messages(req: ResponsesRequest) -> list[ChatMessage]:
    messages = [] if req.instructions is None else [ChatMessage(role="system", content=req.instructions)]
    for item in req.input:
        if item.type == "message":
            messages.append(ChatMessage(role=item.role, content=_text(item.content)))
        elif item.type == "function_call_output":
            messages.append(ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id))
        else:  # a call joins the assistant turn that made it: the text before it, or the calls made with it
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if not messages or messages[-1].role != "assistant":
                messages.append(ChatMessage(role="assistant"))
            messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
    return messages


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return ResponseFormat(type=fmt.type)
    if fmt.name is None:
        raise APIError(422, "text.format.name: required when type is json_schema", param="text.format.name")
    return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))


def _chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    tools = [Tool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return ChatCompletionRequest(
        model=req.model, messages=_messages(req), temperature=req.temperature, top_p=req.top_p, stream=req.stream,
        user=req.user, tools=tools or None, tool_choice=choice, response_format=_response_format(req),
        parallel_tool_calls=req.parallel_tool_calls is not False, priority=req.priority)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(text: str, status: str) -> dict:
    return {"type": "message", "id": _item_id("msg"), "role": "assistant", "status": status,
            "content": [_output_text(text)]}


def _function_call(call: dict, status: str) -> dict:
    """A chat tool call (service.api.tools) as an output item."""
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


class _Response:
    """The response object: what the request set, echoed, and the outcome once known."""

    def __init__(self, req: ResponsesRequest, call: _Call, tool_choice):
        fmt = req.text.format if req.text and req.text.format else None
        self.head = {
            "id": f"resp_{call.generation.engine_id}", "object": "response", "created_at": call.created,
            "model": req.model, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": [t.model_dump() for t in req.tools or []],
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice) else tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "metadata": req.metadata or {}, "user": req.user, "store": False, "background": False,
            "previous_response_id": None}
        self.prompt_tokens = call.prompt_tokens

    def __call__(self, status: str, output: list[dict], generated: int = 0, cached: int = 0,
                 error: dict | None = None) -> dict:
        return {**self.head, "status": status, "output": output, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": _usage(self.prompt_tokens, cached, generated) if status != "in_progress" else None}


def _status(outputs: list[TokenOutput]) -> str:
    return "incomplete" if FINISH_REASONS[outputs[-1].finish_reason] == "length" else "completed"


class _Events:
    """A streamed response's events, numbered: its output items open, grow (text, or a call's arguments) and close
    one after another, each closing when the next opens or the response ends."""

    def __init__(self, response: _Response):
        self.response = response
        self.number = 0
        self.items: list[dict] = []
        self.open = False  # whether the last item is still being written

    def event(self, kind: str, **fields) -> bytes:
        """One event as OpenAI sends it: its type named twice, on the `event:` line and in the JSON."""
        payload = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\n".encode() + sse(payload)

    def _place(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def opening(self) -> bytes:
        created = self.response("in_progress", [])
        return self.event("response.created", response=created) + self.event("response.in_progress", response=created)

    def _add(self, item: dict) -> bytes:
        lines = self._close("completed")
        self.items.append(item)
        self.open = True
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        lines += self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)
        if item["type"] == "message":
            lines += self.event("response.content_part.added", **self._place(), content_index=0,
                                part=_output_text(""))
        return lines

    def _close(self, status: str) -> bytes:
        if not self.open:
            return b""
        self.open = False
        item = self.items[-1]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            lines = self.event("response.output_text.done", **self._place(), content_index=0, text=part["text"],
                               logprobs=[])
            lines += self.event("response.content_part.done", **self._place(), content_index=0, part=part)
        else:
            lines = self.event("response.function_call_arguments.done", **self._place(), arguments=item["arguments"])
        return lines + self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)

    def text(self, piece: str) -> bytes:
        if not piece:
            return b""
        lines = b"" if self.open and self.items[-1]["type"] == "message" else self._add(_message("", "completed"))
        self.items[-1]["content"][0]["text"] += piece
        return lines + self.event("response.output_text.delta", **self._place(), content_index=0, delta=piece,
                                  logprobs=[])

    def open_call(self, call: dict) -> bytes:
        """A call's item, its arguments to come."""
        return self._add({**_function_call(call, "completed"), "arguments": ""})

    def arguments(self, piece: str) -> bytes:
        if not piece:
            return b""
        self.items[-1]["arguments"] += piece
        return self.event("response.function_call_arguments.delta", **self._place(), delta=piece)

    def closing(self, status: str, generated: int, cached: int) -> bytes:
        lines = b"" if self.items else self._add(_message("", "completed"))  # an empty reply is an empty message
        lines += self._close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return lines + self.event(kind, response=self.response(status, self.items, generated, cached))

    def failed(self, error: dict) -> bytes:
        """The error event (the chat stream's error object), then the response, failed."""
        if self.open:
            self.items[-1]["status"] = "incomplete"
        lines = self.event("error", code=error["code"], message=error["message"], param=error["param"])
        failure = {"code": error["code"], "message": error["message"]}
        return lines + self.event("response.failed", response=self.response("failed", self.items, error=failure))


@router.post("/responses")
async def responses(request: Request):
    request.state.endpoint = "responses"  # its own label in the request metrics, errors included
    req = await read_json(request, ResponsesRequest, request.app.state.settings.max_request_bytes)
    _check_stateless(req)
    client = engine(request)
    chat = _chat_request(req)
    tool_choice = _tool_choice(chat, "tools.{}", "tool_choice", "text.format")
    tools = [t.model_dump(exclude_none=True) for t in chat.tools] if tool_choice != "none" else None
    prompt_ids = await _chat_prompt(chat, client, tools, "input")
    forced = forced_grammar(chat.tools, tool_choice, chat.parallel_tool_calls) if tools else None
    grammar = forced or response_format_grammar(chat.response_format)
    call = await _Call.submit(request, chat, "responses", [prompt_ids], req.max_output_tokens, None, False, 0, 1,
                              grammar, "tool_choice" if forced else "text.format", "input", "max_output_tokens")
    response = _Response(req, call, tool_choice)
    fmt = tool_format(client.tokenizer.chat_template)

    if not req.stream:
        choices = await call.generation.collect()
        if choices is None:
            return Response(status_code=499)
        outputs = choices[0]
        status = _status(outputs)
        content, calls = _reply("".join(out.text for out in outputs), tool_choice, forced is not None, tools, fmt)
        items = ([_message(content or "", "completed")] if content or not calls else []) + [
            _function_call(c, "completed") for c in calls]
        items[-1]["status"] = status  # what a length cut stopped is the last item
        body = response(status, items, len(outputs), outputs[0].cached_prompt_tokens)
        return Response(json_bytes(body), media_type="application/json")

    events = _Events(response)
    streams = CallStream(fmt)  # under "auto": text until a call opens
    made = ForcedCalls(tool_choice)  # forced: calls stream as they are written

    def token_events(out: TokenOutput) -> bytes:
        lines = b""
        if forced:
            for delta in made.feed(out.text):
                if "id" in delta:
                    lines += events.open_call(delta)
                lines += events.arguments(delta["function"]["arguments"])
            if out.finished:
                lines += events.text(made.content() or "")  # cut short before a call's name: the text as written
        elif tools:
            lines += events.text(streams.feed(out.text))
            if out.finished:
                rest, calls = streams.finish()
                lines += events.text(rest)
                for c in calls:
                    lines += events.open_call(c) + events.arguments(c["function"]["arguments"])
        else:
            lines += events.text(out.text)
        return lines

    async def stream():
        yield events.opening()
        outputs = []
        try:
            async for batch in call.generation.batches():
                outputs += batch
                lines = b"".join(token_events(out) for out in batch)
                if lines:
                    yield lines
        except EngineStepError as e:
            yield events.failed(stream_error(e, call.generation.grammar_param))
            return
        yield events.closing(_status(outputs), len(outputs), outputs[0].cached_prompt_tokens)

    return EventStream(stream(), call.generation)
