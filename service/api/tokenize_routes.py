"""POST /tokenize and POST /detokenize with the model's own tokenizer. /tokenize answers TGI's body
(`{"inputs"}` -> a list of tokens with their text and character offsets; group `generate`) and vLLM's
(`{"prompt"}` or `{"messages"}` -> ids and count; group `openai`); /detokenize is vLLM's (group `openai`)."""
import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.api.auth import require_api_key
from service.api.body import parse_json, read_body, read_json, validated
from service.api.engine_client import INLINE_TOKENIZE_CHARS
from service.api.errors import APIError
from service.api.generation import engine, json_bytes
from service.api.openai_routes import resolve_model
from service.api.schemas import DetokenizeRequest, TGITokenizeRequest, TokenizeRequest
from service.api.tools import template_messages
from service.text import ChatTemplateError, chat_text, encode_chat

router = APIRouter()


async def _off_loop(size: int, fn, *args, **kwargs):
    """Small texts inline; long ones in a worker thread, so the event loop keeps serving."""
    if size < INLINE_TOKENIZE_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def _json(payload) -> Response:
    return Response(json_bytes(payload), media_type="application/json")


@router.post("/tokenize")
async def tokenize(request: Request):
    client = engine(request)
    # The body says which API (and so which key's route group) it follows.
    data = parse_json(await read_body(request, request.app.state.settings.max_request_bytes))
    tgi = isinstance(data, dict) and "inputs" in data
    require_api_key("generate" if tgi else "openai")(request)
    req = validated(TGITokenizeRequest if tgi else TokenizeRequest, data)
    tokenizer = client.tokenizer
    if tgi:
        if not client.may_fit(req.inputs):
            raise APIError(422, "inputs: longer than the context could ever hold", param="inputs")
        encoding = await _off_loop(len(req.inputs), tokenizer, req.inputs, return_offsets_mapping=True)
        return _json([{"id": i, "text": req.inputs[start:stop], "start": start, "stop": stop}
                      for i, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"])])
    if req.model is not None:
        resolve_model(client, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(422, "prompt: send either prompt or messages", param="prompt")
    if req.tools is not None and req.messages is None:
        raise APIError(422, "tools: only with messages", param="tools")
    if req.prompt is not None:
        if not client.may_fit(req.prompt):
            raise APIError(422, "prompt: longer than the context could ever hold", param="prompt")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await _off_loop(len(req.prompt), tokenizer.encode, req.prompt, add_special_tokens=special)
    else:
        messages = template_messages(req.messages)
        tools = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
        # the texts, the names and calls' arguments that are rendered with them, and the tools
        text = chat_text(messages, tools)
        if not client.may_fit(text):
            raise APIError(422, f"messages: the conversation cannot fit the context of {client.max_model_len} "
                                "tokens", param="messages", code="context_length_exceeded")
        try:
            ids = await _off_loop(len(text), encode_chat, tokenizer, messages, req.add_generation_prompt, **tools)
        except ChatTemplateError as e:
            raise APIError(422, f"messages: {e}", param="messages") from None
        if req.add_special_tokens:
            ids = _with_special_tokens(tokenizer, ids)
    result = {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids}
    if req.return_token_strs:
        result["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return _json(result)


def _with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """ids wrapped in the special tokens the tokenizer adds around a text (BOS, say), found by encoding a probe
    with and without them (transformers 5 tokenizers have no build_inputs_with_special_tokens)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    at = next(i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain)
    return full[:at] + ids + full[at + len(plain):]


@router.post("/detokenize")
async def detokenize(request: Request):
    require_api_key("openai")(request)
    client = engine(request)
    req = await read_json(request, DetokenizeRequest, request.app.state.settings.max_request_bytes)
    if req.model is not None:
        resolve_model(client, req.model)
    vocab = client.info.vocab_size
    if any(t >= vocab for t in req.tokens):
        raise APIError(422, f"tokens: ids must be below the vocabulary size {vocab}", param="tokens")
    return _json({"prompt": await _off_loop(len(req.tokens), client.tokenizer.decode, req.tokens)})
