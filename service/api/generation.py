"""What the TGI and OpenAI routes share: fitting a prompt into the context, submitting it to the engine core,
timing its tokens, and aborting it the moment its client goes away."""
import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse

from service.api.engine_client import (
    AdapterNotServed,
    EngineDead,
    EngineOverloaded,
    EngineStepError,
    GrammarDeadEnd,
    GrammarRejected,
    RequestRejected,
    RequestStream,
    TokenOutput,
)
from service.api.errors import APIError, ClientGone, overloaded, unavailable
from service.metrics import RequestTimer
from service.protocol import Grammar, SamplingParams

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
json_bytes = msgspec.json.Encoder().encode  # NaN and infinities become null: the output is always JSON


def sse(payload) -> bytes:
    """One server-sent event: `payload` as JSON, or as is when it is already bytes (b"[DONE]")."""
    return b"data: " + (payload if isinstance(payload, bytes) else json_bytes(payload)) + b"\n\n"


def engine(request: Request):
    """The app's engine client, or 503 while no engine core serves."""
    client = request.app.state.engine
    if client is None or not client.ready:
        raise unavailable()
    return client


class EventStream(StreamingResponse):
    """A server-sent event response for one generation, released even if the client left before the first
    event was produced (the body iterator then never starts, so its own cleanup never runs)."""

    def __init__(self, events: AsyncIterator[bytes], generation: "Generation"):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                self.generation.release()


def check_stop(stop: list[str], max_stop_sequences: int, param: str) -> None:
    if len(stop) > max_stop_sequences:
        raise APIError(422, f"{param}: at most {max_stop_sequences} stop sequences are allowed, got {len(stop)}",
                       param=param, code="invalid_value")


async def encode_prompt(client, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """The prompt's token ids; a text that cannot fit the context is refused before it is tokenized (a megabyte
    of text takes the tokenizer about a second)."""
    if not client.may_fit(text):
        raise APIError(422, f"{param}: the prompt ({len(text)} characters) cannot fit the context of "
                            f"{client.max_model_len} tokens", param=param, code="context_length_exceeded")
    return await client.encode(text, add_special_tokens)


def fit_context(prompt_tokens: int, max_new_tokens: int | None, default: int | None, max_model_len: int,
                prompt_param: str, max_param: str, budget: int | None = None) -> int:
    """The number of tokens to generate: as asked, else default, else whatever room the context leaves; never
    more than `budget` (see request_budget)."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise APIError(422, f"{prompt_param}: the prompt is {prompt_tokens} tokens, but the context is "
                            f"{max_model_len} tokens including at least one generated token",
                       param=prompt_param, code="context_length_exceeded")
    if max_new_tokens is None:
        chosen = room if default is None else min(default, room)
        return chosen if budget is None else min(chosen, budget)
    if max_new_tokens > room:
        raise APIError(422, f"{max_param}: prompt ({prompt_tokens} tokens) + {max_param} ({max_new_tokens}) "
                            f"must be <= the context length {max_model_len}",
                       param=max_param, code="context_length_exceeded")
    if budget is not None and max_new_tokens > budget:
        raise APIError(422, f"{max_param}: {max_new_tokens} for each sequence exceeds this request's token budget "
                            f"(max_request_tokens: prompts + max_tokens for every sequence); at most {budget}",
                       param=max_param, code="invalid_value")
    return max_new_tokens


def check_sequences(settings, prompts: int, n: int, param: str) -> None:
    """One request may not ask for more than max_request_sequences sequences (prompts x n): beyond, it would take
    whole steps from everyone else."""
    if prompts * n > settings.max_request_sequences:
        raise APIError(422, f"{param}: {prompts} prompt(s) x {n} = {prompts * n} sequences; one request may ask for "
                            f"at most {settings.max_request_sequences} (max_request_sequences)",
                       param=param, code="invalid_value")


def request_budget(settings, prompts: list[list[int]], n: int, prompt_param: str) -> int:
    """The most tokens each of a request's sequences may generate within max_request_tokens, which counts its
    prompts' tokens and max_tokens for every sequence."""
    budget = (settings.max_request_tokens - sum(map(len, prompts))) // (len(prompts) * n)
    if budget < 1:
        raise APIError(422, f"{prompt_param}: the request's prompts leave no room to generate within its token "
                            f"budget of {settings.max_request_tokens} (max_request_tokens)",
                       param=prompt_param, code="invalid_value")
    return budget


def check_priority(settings, priority: int, param: str) -> None:
    """As in vLLM: a priority other than 0 needs the priority scheduling policy."""
    if priority and settings.scheduling_policy != "priority":
        raise APIError(400, f"{param}: this server schedules requests first come, first served (scheduling_policy "
                            f"fcfs), not by priority; got {priority}", param=param, code="invalid_value")


def check_grammar(grammar: Grammar | None, max_bytes: int, param: str) -> None:
    """What a grammar may be before it reaches the engine: at most max_grammar_bytes, and a JSON schema may only
    refer to its own parts (nothing is ever fetched: an external $ref would silently match anything)."""
    if grammar is None:
        return
    if len(grammar.value.encode()) > max_bytes:
        raise APIError(400, f"{param}: the grammar is {len(grammar.value.encode())} bytes; at most {max_bytes} "
                            "(max_grammar_bytes)", param=param, code="invalid_grammar")
    if grammar.kind == "regex" and _SURROGATE.search(grammar.value):
        raise APIError(400, f"{param}: the regex matches UTF-16 surrogates (\\ud800-\\udfff), which are not text",
                       param=param, code="invalid_grammar")
    if grammar.kind != "json" or not grammar.value:
        return
    try:
        schema = json.loads(grammar.value)
    except ValueError:
        return  # the compiler says what is wrong with it
    for keyword, value in _schema_keywords(schema):
        if keyword == "$ref" and isinstance(value, str) and not value.startswith("#"):
            raise APIError(400, f"{param}: $ref {value!r} points outside the schema; only local references ('#...') "
                                "are supported", param=param, code="invalid_grammar")
        if keyword in UNSUPPORTED_KEYWORDS:
            raise APIError(400, f"{param}: the schema keyword {keyword!r} is not supported (the output could not be "
                                "held to it)", param=param, code="invalid_grammar")


# JSON schema keywords xgrammar (0.2.8) does not enforce, or not in general: it would drop them, and outputs would
# not validate. Refused instead. (multipleOf, propertyNames, min/maxProperties and patternProperties it enforces.)
UNSUPPORTED_KEYWORDS = {"not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
                        "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
                        "unevaluatedItems"}
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|[\ud800-\udfff]")


def _schema_keywords(schema):
    """(keyword, value) of every schema in a JSON schema, subschemas included, never property names (a property
    called "not" is no keyword). Iterative: a body nests deeper than Python's recursion reaches."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for keyword, value in node.items():
            yield keyword, value
            if keyword in _SUBSCHEMA_MAPS and isinstance(value, dict):
                stack += value.values()
            elif keyword in _SUBSCHEMA_LISTS and isinstance(value, list):
                stack += value
            elif keyword in ("items", "additionalProperties", "not", "if", "then", "else", "contains") \
                    and isinstance(value, dict):
                stack.append(value)
            elif keyword == "items" and isinstance(value, list):
                stack += value


def by_likelihood(choices: list[list[TokenOutput]]) -> list[int]:
    """best_of: the completions' indexes, the highest total logprob first."""
    return sorted(range(len(choices)), key=lambda i: -sum(out.logprob or 0.0 for out in choices[i]))


class Generation:
    """One admitted request: its completions (n > 1, or several prompts, each a request in the core) as streams
    sharing one wake-up event and one timer. `await Generation.submit(...)` admits it (429 / 422 / 400 / 503 at
    once if the core refuses); batches() streams its outputs, and its outcome is recorded exactly once when it
    ends."""

    def __init__(self, request: Request, endpoint: str, streams: list[RequestStream], prompt_tokens: int,
                 grammar_param: str | None = None):
        self.request = request
        self.grammar_param = grammar_param  # the field that carried the request's grammar, for its errors
        self.streams = streams
        self.engine_id = streams[0].request_id
        request.state.counted = True  # from here on the outcome is recorded by _finish(), not the error handler
        self.timer = RequestTimer(request.app.state.metrics, endpoint, prompt_tokens, streams[0].engine)
        self.ready = asyncio.Event()
        self.interval = request.app.state.settings.stream_interval
        early = 0
        for choice, stream in enumerate(streams):
            stream.choice, stream.timer, stream.ready = choice, self.timer, self.ready
            if stream.waiting or stream.finished:  # it woke its own event before this one took over
                self.ready.set()
                early += len(stream.waiting)
        if early:  # tokens that arrived before the timer was attached: counted now
            self.timer.on_tokens(time.perf_counter(), early, [])
        self.outcome = "aborted"  # until the engine says it finished
        self.done = False

    @classmethod
    async def submit(cls, request: Request, endpoint: str, prompts: list[list[int]], params: SamplingParams,
                     adapter: str | None, prompt_param: str, grammar_param: str | None = None,
                     user: str | None = None) -> "Generation":
        """Admits each prompt (params.n completions of each); choice i * n + j is prompt i's completion j. Its
        sequences share one share of each step with the rest of this request, or with every request of `user`."""
        client = engine(request)
        # The client may reuse its X-Request-Id; the engine (and the OpenAI response id) needs a unique id.
        ids = [f"{request.state.request_id}-{secrets.token_hex(4)}" for _ in prompts]
        group = f"user:{user}" if user else ids[0]
        admission = asyncio.gather(*(client.add_request(rid, prompt, params, adapter, group)
                                     for rid, prompt in zip(ids, prompts)), return_exceptions=True)
        # Admission can take seconds (a grammar compiling): a client that leaves meanwhile takes its request along.
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({admission, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not admission.done():
            admission.cancel()  # each add_request tells its core to drop the request
            await asyncio.gather(admission, return_exceptions=True)
            raise ClientGone()
        results = admission.result()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for streams in results:
                for stream in streams if isinstance(streams, list) else []:
                    client.abort(stream.request_id)
            try:
                raise errors[0]
            except EngineOverloaded:
                raise overloaded() from None
            except GrammarRejected as e:
                raise APIError(400, f"{grammar_param}: {e}", param=grammar_param, code="invalid_grammar") from None
            except AdapterNotServed as e:
                raise APIError(404, str(e), code="model_not_found") from None
            except RequestRejected as e:  # what the core can judge: the prompt against the model and KV cache
                raise APIError(422, f"{prompt_param}: {e}", param=prompt_param, code="invalid_value") from None
            except EngineDead:
                raise unavailable() from None
        return cls(request, endpoint, [s for streams in results for s in streams], sum(map(len, prompts)),
                   grammar_param)

    async def batches(self) -> AsyncIterator[list[TokenOutput]]:
        """The request's tokens (of every completion, each with its `choice`), in lists of those that arrived
        since the last one was taken. A completion's tokens are taken `interval` (stream_interval) at a time, but
        its first at once and its last when it ends, as vLLM streams them."""
        try:
            while True:
                await self.ready.wait()
                self.ready.clear()
                batch = [out for stream in self.streams if self._due(stream) for out in stream.take()]
                if batch:
                    yield batch
                for stream in self.streams:
                    if stream.error is not None:
                        raise stream.error
                if all(stream.finished and not stream.waiting for stream in self.streams):
                    self.outcome = "success"
                    return
        except GrammarDeadEnd:
            self.outcome = "validation_error"
            raise
        except Exception:  # EngineStepError, or a bug; cancellation (client gone) is not an Exception
            self.outcome = "internal_error"
            raise
        finally:
            self.release()

    def _due(self, stream: RequestStream) -> bool:
        waiting = stream.waiting
        return stream.finished or len(waiting) >= self.interval or bool(waiting) and waiting[0].index == 0

    def release(self) -> None:
        """Ends the request once: aborts what still runs in the core, and records its outcome."""
        if self.done:
            return
        self.done = True
        for stream in self.streams:
            self.request.app.state.engine.abort(stream.request_id)
        self.timer.finish(self.outcome, self.streams)
        self.request.state.generation = (self.outcome, self.timer.prompt_tokens, self.timer.generated_tokens)

    async def collect(self) -> list[list[TokenOutput]] | None:
        """Each completion's outputs, or None if the client disconnected first (the request is then aborted at
        once)."""
        async def run():
            choices = [[] for _ in self.streams]
            async for batch in self.batches():
                for out in batch:
                    choices[out.choice].append(out)
            return choices

        work = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(_disconnected(self.request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            self.release()
        if work.cancelled():
            return None
        try:
            return work.result()
        except GrammarDeadEnd as e:
            param = self.grammar_param
            raise APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None
        except EngineStepError as e:
            raise APIError(500, f"generation failed: {e}", code="engine_error") from None


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server delivers is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
