"""text-generation-inference routes: POST /generate, POST /generate_stream, and POST / (either, by `stream`),
which is where huggingface_hub's InferenceClient(base_url).text_generation posts. `parameters.grammar` constrains
the output (a JSON schema or a regex); `best_of` samples several and returns the likeliest."""
import json
import random

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
from service.api.schemas import TGIGrammar, TGIParameters, TGIRequest
from service.protocol import Grammar, SamplingParams, choice_seed

DEFAULT_MAX_NEW_TOKENS = 100  # TGI's documented default, capped by the room the context leaves
FINISH_REASONS = {"length": "length", "eos_token": "eos_token", "stop": "stop_sequence"}

router = APIRouter(dependencies=[Depends(require_api_key("generate"))])


def _samples(p: TGIParameters) -> bool:
    # As TGI: greedy unless do_sample, or any warper set away from its neutral value.
    return p.do_sample or p.temperature not in (None, 1.0) or p.top_k not in (None, 0) or p.top_p not in (None, 1.0)


def grammar(g: TGIGrammar | None) -> Grammar | None:
    if g is None:
        return None
    if g.type == "regex":
        if not isinstance(g.value, str):
            raise APIError(422, "parameters.grammar.value: a regex must be a string", param="parameters.grammar.value")
        return Grammar("regex", g.value)
    return Grammar("json", g.value if isinstance(g.value, str) else json.dumps(g.value))


def sampling_params(p: TGIParameters, max_new_tokens: int) -> SamplingParams:
    sample = _samples(p)
    seed = p.seed
    if sample and seed is None:
        seed = random.getrandbits(63)  # so that details.seed reports what reproduces the output
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=(p.temperature or 1.0) if sample else 0.0,
        top_k=p.top_k or 0, top_p=p.top_p or 1.0, repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        seed=seed if sample else None, stop=p.stop or [], include_stop_str_in_output=True, logprobs=True,
        ignore_eos=p.ignore_eos, grammar=grammar(p.grammar), n=p.best_of or 1, priority=p.priority)


def _token(out: TokenOutput) -> dict:
    return {"id": out.token_id, "text": out.text, "logprob": out.logprob, "special": out.special}


def _generated_text(body: TGIRequest, text: str) -> str:
    return body.inputs + text if body.parameters.return_full_text else text


async def _submit(request: Request, body: TGIRequest, endpoint: str) -> tuple[Generation, SamplingParams, list[int]]:
    client = engine(request)
    p, settings = body.parameters, request.app.state.settings
    check_stop(p.stop or [], settings.max_stop_sequences, "parameters.stop")
    check_priority(settings, p.priority, "parameters.priority")
    check_sequences(settings, 1, p.best_of or 1, "parameters.best_of")
    prompt_ids = await encode_prompt(client, body.inputs, "inputs")
    if p.truncate is not None:
        prompt_ids = prompt_ids[-p.truncate:]
    max_new_tokens = fit_context(len(prompt_ids), p.max_new_tokens, DEFAULT_MAX_NEW_TOKENS, client.max_model_len,
                                 "inputs", "parameters.max_new_tokens",
                                 request_budget(settings, [prompt_ids], p.best_of or 1, "inputs"))
    if (p.best_of or 1) > 1:
        if not _samples(p):
            raise APIError(422, "parameters.best_of: > 1 needs sampling (do_sample, or a temperature, top_k or top_p)",
                           param="parameters.best_of")
        if endpoint == "generate_stream":
            raise APIError(422, "parameters.best_of: > 1 cannot be streamed", param="parameters.best_of")
    params = sampling_params(p, max_new_tokens)
    check_grammar(params.grammar, settings.max_grammar_bytes, "parameters.grammar")
    generation = await Generation.submit(request, endpoint, [prompt_ids], params, _adapter(client, p.adapter_id),
                                         "inputs", "parameters.grammar")
    return generation, params, prompt_ids


def _adapter(client, adapter_id: str | None) -> str | None:
    if adapter_id is None or adapter_id == client.model_name:
        return None
    if adapter_id not in client.served_models():
        raise APIError(422, f"parameters.adapter_id: unknown adapter {adapter_id!r}; served: "
                            f"{', '.join(client.served_models())}", param="parameters.adapter_id")
    return adapter_id


async def _generate(request: Request, body: TGIRequest) -> Response:
    generation, params, prompt_ids = await _submit(request, body, "generate")
    choices = await generation.collect()
    if choices is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    # best_of: the likeliest sequence answers; the others are in details.best_of_sequences
    ranked = by_likelihood(choices)
    outputs = choices[ranked[0]]
    result = {"generated_text": _generated_text(body, "".join(out.text for out in outputs))}
    if body.parameters.details:
        decode = request.app.state.engine.tokenizer.decode
        prefill = ([{"id": t, "text": decode([t]), "logprob": None} for t in prompt_ids]
                   if body.parameters.decoder_input_details else [])

        def details(i: int) -> dict:
            seed = None if params.seed is None else choice_seed(params.seed, i)
            return {"finish_reason": FINISH_REASONS[choices[i][-1].finish_reason],
                    "generated_tokens": len(choices[i]), "seed": seed, "prefill": prefill,
                    "tokens": [_token(out) for out in choices[i]]}

        result["details"] = details(ranked[0])
        if len(choices) > 1:
            result["details"]["best_of_sequences"] = [
                {"generated_text": _generated_text(body, "".join(out.text for out in choices[i])), **details(i)}
                for i in ranked[1:]]
    return Response(json_bytes(result), media_type="application/json")


async def _generate_stream(request: Request, body: TGIRequest) -> Response:
    generation, params, _ = await _submit(request, body, "generate_stream")

    async def events():
        text = []
        try:
            async for batch in generation.batches():
                chunk = []
                for out in batch:
                    text.append(out.text)
                    event = {"index": out.index, "token": _token(out), "top_tokens": None,
                             "generated_text": None, "details": None}
                    if out.finished:
                        event["generated_text"] = _generated_text(body, "".join(text))
                        event["details"] = {"finish_reason": FINISH_REASONS[out.finish_reason],
                                            "generated_tokens": out.index + 1, "seed": params.seed,
                                            "input_length": generation.timer.prompt_tokens}
                    chunk.append(sse(event))
                yield b"".join(chunk)
        except GrammarDeadEnd as e:  # TGI's type for errors in the request
            yield sse({"error": f"parameters.grammar: {e}", "error_type": "validation"})
        except EngineStepError as e:
            yield sse({"error": f"generation failed: {e}", "error_type": "generation"})

    return EventStream(events(), generation)


@router.post("/generate")
async def generate(request: Request):
    return await _generate(request, await read_json(request, TGIRequest, request.app.state.settings.max_request_bytes))


@router.post("/generate_stream")
async def generate_stream(request: Request):
    body = await read_json(request, TGIRequest, request.app.state.settings.max_request_bytes)
    return await _generate_stream(request, body)


@router.post("/")
async def compat_generate(request: Request):
    body = await read_json(request, TGIRequest, request.app.state.settings.max_request_bytes)
    if body.stream:
        request.state.endpoint = "generate_stream"
        return await _generate_stream(request, body)
    return await _generate(request, body)
