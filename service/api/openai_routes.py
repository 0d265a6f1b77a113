"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both streaming or not), /v1/models."""
import time
from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from service.api.auth import require_api_key
from service.api.body import read_json
from service.api.engine_client import EngineStepError, TokenOutput
from service.api.errors import APIError
from service.api.generation import (
    EventStream,
    Generation,
    check_stop,
    encode_prompt,
    engine,
    fit_context,
    json_bytes,
    sse,
)
from service.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from service.protocol import SamplingParams
from service.text import ChatTemplateError

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


def _sampling_params(req: OpenAIRequest, max_new_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
        repetition_penalty=req.repetition_penalty or 1.0, frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0, logit_bias=req.logit_bias or {}, min_p=req.min_p or 0.0,
        min_tokens=req.min_tokens or 0, seed=req.seed, stop=req.stop or [], logprobs=logprobs,
        top_logprobs=top_logprobs, ignore_eos=req.ignore_eos)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _stream_error(e: EngineStepError) -> bytes:
    return sse({"error": {"message": f"generation failed: {e}", "type": "internal_error", "param": None,
                          "code": "engine_error"}})


class _Call:
    """What both endpoints do with a request once its prompt is tokenized."""

    @classmethod
    async def submit(cls, request: Request, req: OpenAIRequest, endpoint: str, prompt_ids: list[int],
                     max_tokens: int | None, default_max_tokens: int | None, logprobs: bool,
                     top_logprobs: int) -> "_Call":
        self = cls()
        client = engine(request)
        self.tokenizer = client.tokenizer
        adapter = resolve_model(client, req.model)
        check_stop(req.stop or [], request.app.state.settings.max_stop_sequences, "stop")
        if req.stream_options is not None and not req.stream:
            raise APIError(422, "stream_options: only allowed with stream=true", param="stream_options")
        prompt_param = "prompt" if endpoint == "completions" else "messages"
        max_new_tokens = fit_context(len(prompt_ids), max_tokens, default_max_tokens, client.max_model_len,
                                     prompt_param, "max_tokens")
        if any(token >= client.info.vocab_size for token in req.logit_bias or {}):
            raise APIError(422, f"logit_bias: token ids must be below the vocabulary size {client.info.vocab_size}",
                           param="logit_bias")
        if (req.min_tokens or 0) > max_new_tokens:
            raise APIError(422, f"min_tokens: more than the {max_new_tokens} tokens this request may generate",
                           param="min_tokens")
        self.params = _sampling_params(req, max_new_tokens, logprobs, top_logprobs)
        self.generation = await Generation.submit(request, endpoint, prompt_ids, self.params, adapter, prompt_param)
        self.id = f"{'cmpl' if endpoint == 'completions' else 'chatcmpl'}-{self.generation.engine_id}"
        self.model = req.model
        self.created = int(time.time())
        self.prompt_tokens = len(prompt_ids)
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return self

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def stream(self, opening: bytes | None, token_chunk: Callable[[TokenOutput], bytes | None], obj: str):
        """The SSE lines of a streamed response: `opening`, then `token_chunk` of every token (None sends
        nothing), the usage chunk when the client asked for it, and [DONE]; an engine failure ends the stream
        with an error event instead. The chunks of the tokens that arrived together go out in one write."""
        if opening is not None:
            yield opening
        generated = 0
        try:
            async for batch in self.generation.batches():
                generated += len(batch)
                chunks = [line for out in batch if (line := token_chunk(out)) is not None]
                if chunks:
                    yield b"".join(chunks)
        except EngineStepError as e:
            yield _stream_error(e)
            return
        if self.include_usage:
            yield sse({"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                       "usage": _usage(self.prompt_tokens, generated)})
        yield sse(b"[DONE]")


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
    prompt_ids = await encode_prompt(client, req.prompt, "prompt") if isinstance(req.prompt, str) else req.prompt
    want_logprobs = req.logprobs is not None
    call = await _Call.submit(request, req, "completions", prompt_ids, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS,
                              want_logprobs, req.logprobs or 0)
    echo = client.tokenizer.decode(prompt_ids) if req.echo else ""

    def choice(text: str, outputs: list[TokenOutput], offset: int, finish_reason: str | None) -> dict:
        logprobs = _completion_logprobs(call, outputs, offset, bool(req.logprobs)) if want_logprobs else None
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    if not req.stream:
        outputs = await call.generation.collect()
        if outputs is None:
            return Response(status_code=499)
        text = echo + "".join(out.text for out in outputs)
        return _json({"id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
                      "choices": [choice(text, outputs, len(echo), FINISH_REASONS[outputs[-1].finish_reason])],
                      "usage": _usage(call.prompt_tokens, len(outputs))})

    def chunk(text: str, outputs: list[TokenOutput], offset: int, finish_reason: str | None) -> bytes:
        return sse({"id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
                    "choices": [choice(text, outputs, offset, finish_reason)], "usage": None})

    offset = len(echo)

    def token_chunk(out: TokenOutput) -> bytes | None:
        nonlocal offset
        start, offset = offset, offset + len(out.text)
        if out.text or out.finished or want_logprobs:
            return chunk(out.text, [out], start, FINISH_REASONS.get(out.finish_reason))
        return None

    opening = chunk(echo, [], 0, None) if echo else None
    return EventStream(call.stream(opening, token_chunk, "text_completion"), call.generation)


# -- /v1/chat/completions -----------------------------------------------------------------------------------

async def _chat_prompt(req: ChatCompletionRequest, client) -> list[int]:
    if not client.tokenizer.chat_template:
        raise APIError(422, "messages: this model has no chat template; use /v1/completions", param="messages")
    messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
    if not client.may_fit("".join(m["content"] for m in messages)):
        raise APIError(422, f"messages: the conversation cannot fit the context of {client.max_model_len} tokens",
                       param="messages", code="context_length_exceeded")
    try:
        return await client.encode_chat(messages)
    except ChatTemplateError as e:  # the template's own checks (roles must alternate, ...), or a forged turn
        raise APIError(422, f"messages: {e}", param="messages", code="invalid_value") from None


def _chat_logprobs(call: _Call, outputs: list[TokenOutput]) -> dict:
    def entry(token_id: int, logprob: float | None) -> dict:
        text = call.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(out.token_id, out.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in out.top_logprobs or []]} for out in outputs]}


@router.post("/chat/completions")
async def chat_completions(request: Request):
    req = await read_json(request, ChatCompletionRequest, request.app.state.settings.max_request_bytes)
    prompt_ids = await _chat_prompt(req, engine(request))
    if req.top_logprobs and not req.logprobs:
        raise APIError(422, "top_logprobs: requires logprobs=true", param="top_logprobs", code="invalid_value")
    call = await _Call.submit(request, req, "chat_completions", prompt_ids, req.max_completion_tokens or req.max_tokens,
                              None, req.logprobs, req.top_logprobs or 0)

    if not req.stream:
        outputs = await call.generation.collect()
        if outputs is None:
            return Response(status_code=499)
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(out.text for out in outputs)},
                  "logprobs": _chat_logprobs(call, outputs) if req.logprobs else None,
                  "finish_reason": FINISH_REASONS[outputs[-1].finish_reason]}
        return _json({"id": call.id, "object": "chat.completion", "created": call.created, "model": call.model,
                      "choices": [choice], "usage": _usage(call.prompt_tokens, len(outputs))})

    def chunk(delta: dict, outputs: list[TokenOutput], finish_reason: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": _chat_logprobs(call, outputs) if req.logprobs else None,
                  "finish_reason": finish_reason}
        return sse({"id": call.id, "object": "chat.completion.chunk", "created": call.created, "model": call.model,
                    "choices": [choice], "usage": None})

    def token_chunk(out: TokenOutput) -> bytes | None:
        if out.text or out.finished or req.logprobs:
            return chunk({"content": out.text} if out.text else {}, [out], FINISH_REASONS.get(out.finish_reason))
        return None

    opening = chunk({"role": "assistant", "content": ""}, [], None)
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
