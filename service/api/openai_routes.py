"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both streaming or not, n completions, batched
prompts, structured outputs, tool calling), /v1/models."""
import json
import time
from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from service.api.auth import require_api_key
from service.api.body import read_json
from service.api.engine_client import EngineStepError, GrammarDeadEnd, TokenOutput
from service.api.errors import APIError
from service.api.generation import (
    EventStream,
    Generation,
    by_likelihood,
    check_grammar,
    check_priority,
    check_sequences,
    check_stop,
    encode_prompt,
    engine,
    fit_context,
    json_bytes,
    request_budget,
    sse,
)
from service.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest, ResponseFormat
from service.api.tools import (
    CallStream,
    ForcedCalls,
    forced_grammar,
    parse_calls,
    template_messages,
    tool_format,
)
from service.protocol import Grammar, SamplingParams
from service.text import ChatTemplateError, chat_text

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context's room
FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop": "stop"}
# Placeholders TGI clients send for "the model this server serves": TGI's docs use "tgi", and
# huggingface_hub's InferenceClient(base_url=...).chat_completion sends "dummy".
BASE_MODEL_ALIASES = {"tgi", "dummy"}

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key("openai"))])


def resolve_model(client, model: str) -> str | None:
    """The adapter a `model` names (None: the base model), or 404."""
    if model == client.model_name or model in BASE_MODEL_ALIASES:
        return None
    if model in client.served_models():
        return model
    raise APIError(404, f"The model `{model}` does not exist; GET /v1/models lists the served models",
                   param="model", code="model_not_found")


def _sampling_params(req: OpenAIRequest, max_new_tokens: int, logprobs: bool, top_logprobs: int, n: int,
                     grammar: Grammar | None) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
        repetition_penalty=req.repetition_penalty or 1.0, frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0, logit_bias=req.logit_bias or {}, min_p=req.min_p or 0.0,
        min_tokens=req.min_tokens or 0, seed=req.seed, stop=req.stop or [], logprobs=logprobs,
        top_logprobs=top_logprobs, ignore_eos=req.ignore_eos, grammar=grammar, n=n, priority=req.priority)


def response_format_grammar(response_format: ResponseFormat | None) -> Grammar | None:
    """Structured outputs: the grammar a response_format asks for (None for text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Grammar("json")
    if response_format.json_schema is None:
        raise APIError(422, "response_format.json_schema: required when type is json_schema",
                       param="response_format.json_schema")
    schema = response_format.json_schema.schema_
    return Grammar("json", "" if schema is None else json.dumps(schema))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def stream_error(e: EngineStepError, grammar_param: str | None) -> dict:
    """The error object of a stream whose generation failed."""
    if isinstance(e, GrammarDeadEnd):  # the client's grammar, not the engine, failed
        return {"message": f"{grammar_param}: {e}", "type": "invalid_request_error", "param": grammar_param,
                "code": "invalid_grammar"}
    return {"message": f"generation failed: {e}", "type": "internal_error", "param": None, "code": "engine_error"}


class _Call:
    """What both endpoints do with a request once its prompts are tokenized: admit each prompt's `n` completions
    (choice i * n + j is prompt i's completion j)."""

    @classmethod
    async def submit(cls, request: Request, req: OpenAIRequest, endpoint: str, prompts: list[list[int]],
                     max_tokens: int | None, default_max_tokens: int | None, logprobs: bool,
                     top_logprobs: int, n: int, grammar: Grammar | None, grammar_param: str,
                     prompt_param: str = "messages", max_param: str = "max_tokens") -> "_Call":
        self = cls()
        client = engine(request)
        self.tokenizer = client.tokenizer
        adapter = resolve_model(client, req.model)
        settings = request.app.state.settings
        check_stop(req.stop or [], settings.max_stop_sequences, "stop")
        check_priority(settings, req.priority, "priority")
        check_grammar(grammar, settings.max_grammar_bytes, grammar_param)
        if req.stream_options is not None and not req.stream:
            raise APIError(422, "stream_options: only allowed with stream=true", param="stream_options")
        max_new_tokens = fit_context(max(map(len, prompts)), max_tokens, default_max_tokens, client.max_model_len,
                                     prompt_param, max_param, request_budget(settings, prompts, n, prompt_param))
        if any(token >= client.info.vocab_size for token in req.logit_bias or {}):
            raise APIError(422, f"logit_bias: token ids must be below the vocabulary size {client.info.vocab_size}",
                           param="logit_bias")
        if (req.min_tokens or 0) > max_new_tokens:
            raise APIError(422, f"min_tokens: more than the {max_new_tokens} tokens this request may generate",
                           param="min_tokens")
        self.params = _sampling_params(req, max_new_tokens, logprobs, top_logprobs, n, grammar)
        self.generation = await Generation.submit(request, endpoint, prompts, self.params, adapter, prompt_param,
                                                  grammar_param, req.user)
        self.id = f"{'cmpl' if endpoint == 'completions' else 'chatcmpl'}-{self.generation.engine_id}"
        self.model = req.model
        self.created = int(time.time())
        self.prompt_tokens = sum(map(len, prompts))
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return self

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def stream(self, opening: bytes | None, token_chunk: Callable[[list[TokenOutput]], bytes | None],
                     obj: str):
        """The SSE lines of a streamed response: `opening`, then `token_chunk` of every run of one choice's tokens,
        stream_interval tokens at most (None sends nothing), the usage chunk when the client asked for it, and
        [DONE]; an engine failure ends the stream with an error event instead. The chunks of the tokens that
        arrived together go out in one write."""
        if opening is not None:
            yield opening
        generated = 0
        try:
            async for batch in self.generation.batches():
                generated += len(batch)
                chunks = [line for run in _runs(batch, self.generation.interval)
                          if (line := token_chunk(run)) is not None]
                if chunks:
                    yield b"".join(chunks)
        except EngineStepError as e:
            yield sse({"error": stream_error(e, self.generation.grammar_param)})
            return
        if self.include_usage:
            yield sse({"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                       "usage": _usage(self.prompt_tokens, generated)})
        yield sse(b"[DONE]")


def _runs(batch: list[TokenOutput], size: int):
    """The batch's tokens in runs of consecutive tokens of one choice, `size` at most (one chunk each)."""
    run = []
    for out in batch:
        if run and (out.choice != run[0].choice or len(run) == size):
            yield run
            run = []
        run.append(out)
    if run:
        yield run


def _json(content: dict) -> Response:
    return Response(json_bytes(content), media_type="application/json")


# -- /v1/completions ----------------------------------------------------------------------------------------

def _completion_logprobs(call: _Call, outputs: list[TokenOutput], offset: int, want_top: bool) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for out in outputs:
        tokens.append(call.token_text(out.token_id))
        token_logprobs.append(out.logprob)
        top.append({call.token_text(t): lp for t, lp in out.top_logprobs or []} if want_top else None)
        offsets.append(offset)
        offset += len(out.text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top if want_top else None,
            "text_offset": offsets}


@router.post("/completions")
async def completions(request: Request):
    req = await read_json(request, CompletionRequest, request.app.state.settings.max_request_bytes)
    client = engine(request)
    best_of = req.best_of or req.n
    check_sequences(request.app.state.settings, len(req.prompt), best_of, "best_of" if req.best_of else "n")
    prompts = [await encode_prompt(client, p, "prompt") if isinstance(p, str) else p for p in req.prompt]
    if best_of < req.n:
        raise APIError(422, f"best_of: must be >= n ({req.n})", param="best_of")
    if req.stream and best_of > req.n:
        raise APIError(422, "best_of: cannot be streamed (the best are known at the end); use n", param="best_of")
    want_logprobs = req.logprobs is not None
    call = await _Call.submit(request, req, "completions", prompts, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS,
                              want_logprobs or best_of > req.n, req.logprobs or 0, best_of,
                              response_format_grammar(req.response_format), "response_format", "prompt")
    echoes = [client.tokenizer.decode(p) if req.echo else "" for p in prompts]

    def choice(index: int, text: str, outputs: list[TokenOutput], offset: int, finish_reason: str | None) -> dict:
        logprobs = _completion_logprobs(call, outputs, offset, bool(req.logprobs)) if want_logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    if not req.stream:
        choices = await call.generation.collect()
        if choices is None:
            return Response(status_code=499)
        body = []
        for i, echo in enumerate(echoes):
            group = choices[i * best_of:(i + 1) * best_of]
            for outputs in [group[k] for k in by_likelihood(group)[:req.n]]:
                text = echo + "".join(out.text for out in outputs)
                body.append(choice(len(body), text, outputs, len(echo), FINISH_REASONS[outputs[-1].finish_reason]))
        return _json({"id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
                      "choices": body, "usage": _usage(call.prompt_tokens, sum(map(len, choices)))})

    def chunk(index: int, text: str, outputs: list[TokenOutput], offset: int, finish_reason: str | None) -> bytes:
        return sse({"id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
                    "choices": [choice(index, text, outputs, offset, finish_reason)], "usage": None})

    offsets = [len(echoes[i // req.n]) for i in range(len(prompts) * req.n)]

    def token_chunk(run: list[TokenOutput]) -> bytes | None:
        i, last, text = run[0].choice, run[-1], "".join(out.text for out in run)
        start = offsets[i]
        offsets[i] += len(text)
        if text or last.finished or want_logprobs:
            return chunk(i, text, run, start, FINISH_REASONS.get(last.finish_reason))
        return None

    opening = b"".join(chunk(i, echoes[i // req.n], [], 0, None) for i in range(len(offsets))) if req.echo else None
    return EventStream(call.stream(opening, token_chunk, "text_completion"), call.generation)


# -- /v1/chat/completions -----------------------------------------------------------------------------------

async def _chat_prompt(req: ChatCompletionRequest, client, tools: list[dict] | None,
                       param: str = "messages") -> list[int]:
    if not client.tokenizer.chat_template:
        raise APIError(422, f"{param}: this model has no chat template; use /v1/completions", param=param)
    messages = template_messages(req.messages)
    if not client.may_fit(chat_text(messages, tools)):  # names and calls' arguments count too
        raise APIError(422, f"{param}: the conversation cannot fit the context of {client.max_model_len} tokens",
                       param=param, code="context_length_exceeded")
    try:
        return await client.encode_chat(messages, tools)
    except ChatTemplateError as e:  # the template's own checks (roles must alternate, ...), or a forged turn
        raise APIError(422, f"{param}: {e}", param=param, code="invalid_value") from None


def _chat_logprobs(call: _Call, outputs: list[TokenOutput]) -> dict:
    def entry(token_id: int, logprob: float | None) -> dict:
        text = call.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(out.token_id, out.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in out.top_logprobs or []]} for out in outputs]}


def _tool_choice(req: ChatCompletionRequest, tool_field: str = "tools.{}.function",
                 choice_field: str = "tool_choice.function", format_field: str = "response_format"):
    """The effective tool_choice ("none" without tools), checked against the tools. The fields name what errors
    point at (the Responses API's tools are flat)."""
    names = [t.function.name for t in req.tools or []]
    choice = req.tool_choice or ("auto" if names else "none")
    if choice != "none" and not names:
        raise APIError(422, "tool_choice: requires tools", param="tool_choice")
    if not isinstance(choice, str) and choice.function.name not in names:
        raise APIError(422, f"{choice_field}.name: no tool named {choice.function.name!r} in tools",
                       param=f"{choice_field}.name")
    if len(set(names)) != len(names):
        raise APIError(422, "tools: function names must be unique", param="tools")
    for i, tool in enumerate(req.tools or []):
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":  # the arguments of a call are an object
            field = f"{tool_field.format(i)}.parameters"
            raise APIError(422, f'{field}: must be the schema of an object ("type": "object"), not {kind!r}',
                           param=field, code="invalid_value")
    forced = choice == "required" or not isinstance(choice, str)
    if forced and req.response_format is not None and req.response_format.type != "text":
        raise APIError(422, f"{format_field}: cannot be combined with a forced tool_choice", param=format_field)
    return choice


def _reply(text: str, tool_choice, forced: bool, tools: list[dict] | None, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a reply: a forced choice's calls as written, calls parsed from it under "auto", else its
    text."""
    if forced:
        made = ForcedCalls(tool_choice)
        made.feed(text)
        return made.content(), made.calls
    if tools:
        return parse_calls(text, fmt)
    return text, []


def _finish(reason: str, calls: list[dict], forced: bool) -> str:
    """The finish_reason of a chat choice whose generation ended for `reason`."""
    if forced:  # its grammar completed the calls, or the length limit cut them short: say which
        return "tool_calls" if reason == "stop" else reason
    # As vLLM: under "auto" a reply that made calls says so, also when it went on past them to its length limit.
    return "tool_calls" if calls else reason


@router.post("/chat/completions")
async def chat_completions(request: Request):
    req = await read_json(request, ChatCompletionRequest, request.app.state.settings.max_request_bytes)
    client = engine(request)
    check_sequences(request.app.state.settings, 1, req.n, "n")
    tool_choice = _tool_choice(req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if tool_choice != "none" else None
    prompt_ids = await _chat_prompt(req, client, tools)
    if req.top_logprobs and not req.logprobs:
        raise APIError(422, "top_logprobs: requires logprobs=true", param="top_logprobs", code="invalid_value")
    forced = forced_grammar(req.tools, tool_choice, req.parallel_tool_calls) if tools else None
    grammar = forced or response_format_grammar(req.response_format)
    call = await _Call.submit(request, req, "chat_completions", [prompt_ids],
                              req.max_completion_tokens or req.max_tokens, None, req.logprobs, req.top_logprobs or 0,
                              req.n, grammar, "tool_choice" if forced else "response_format")
    fmt = tool_format(client.tokenizer.chat_template)

    def message(text: str) -> tuple[dict, list[dict]]:
        content, calls = _reply(text, tool_choice, forced is not None, tools, fmt)
        result = {"role": "assistant", "content": content}
        if calls:
            result["tool_calls"] = calls
        return result, calls

    if not req.stream:
        choices = await call.generation.collect()
        if choices is None:
            return Response(status_code=499)
        body = []
        for index, outputs in enumerate(choices):
            msg, calls = message("".join(out.text for out in outputs))
            body.append({"index": index, "message": msg,
                         "logprobs": _chat_logprobs(call, outputs) if req.logprobs else None,
                         "finish_reason": _finish(FINISH_REASONS[outputs[-1].finish_reason], calls,
                                                  forced is not None)})
        return _json({"id": call.id, "object": "chat.completion", "created": call.created, "model": call.model,
                      "choices": body, "usage": _usage(call.prompt_tokens, sum(map(len, choices)))})

    def chunk(index: int, delta: dict, outputs: list[TokenOutput], finish_reason: str | None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": _chat_logprobs(call, outputs) if req.logprobs else None,
                  "finish_reason": finish_reason}
        return sse({"id": call.id, "object": "chat.completion.chunk", "created": call.created, "model": call.model,
                    "choices": [choice], "usage": None})

    streams = [CallStream(fmt) for _ in range(req.n)]  # under "auto": content until a call opens
    made = [ForcedCalls(tool_choice) for _ in range(req.n)]  # forced: calls stream as they are written

    def token_chunk(run: list[TokenOutput]) -> bytes | None:
        i, text, reason = run[0].choice, "".join(out.text for out in run), FINISH_REASONS.get(run[-1].finish_reason)
        if not tools:
            if text or run[-1].finished or req.logprobs:
                return chunk(i, {"content": text} if text else {}, run, reason)
            return None
        lines = []
        if forced:
            deltas = made[i].feed(text)
            if deltas or req.logprobs:
                lines.append(chunk(i, {"tool_calls": deltas} if deltas else {}, run, None))
        else:
            piece = streams[i].feed(text)
            if piece or req.logprobs:
                lines.append(chunk(i, {"content": piece} if piece else {}, run, None))
        if reason is not None:
            if forced:
                calls, rest = made[i].calls, made[i].content()
            else:
                rest, calls = streams[i].finish()
            if rest:
                lines.append(chunk(i, {"content": rest}, [], None))
            if calls and not forced:
                lines.append(chunk(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, [], None))
            lines.append(chunk(i, {}, [], _finish(reason, calls, forced is not None)))
        return b"".join(lines) or None

    opening = b"".join(chunk(i, {"role": "assistant", "content": None if forced else ""}, [], None)
                       for i in range(req.n))
    return EventStream(call.stream(opening, token_chunk, "chat.completion.chunk"), call.generation)


# -- /v1/models ---------------------------------------------------------------------------------------------

def _model_card(request: Request, name: str) -> dict:
    client = engine(request)
    card = {"id": name, "object": "model", "created": request.app.state.started, "owned_by": "tritonserve",
            "max_model_len": client.max_model_len}
    if name != client.model_name:
        card["parent"] = client.model_name
    return card


@router.get("/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(request, name) for name in engine(request).served_models()]}


@router.get("/models/{model:path}")
async def retrieve_model(request: Request, model: str):
    if model not in engine(request).served_models():
        raise APIError(404, f"The model `{model}` does not exist", param="model", code="model_not_found")
    return _model_card(request, model)
