"""What the TGI and OpenAI routes share: fitting a prompt into the context, submitting it to the engine core,
timing its tokens, and aborting it the moment its client goes away."""
import asyncio
import secrets
from collections.abc import AsyncIterator

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse

from service.api.engine_client import (
    EngineDead,
    EngineOverloaded,
    EngineStepError,
    RequestRejected,
    RequestStream,
    TokenOutput,
)
from service.api.errors import APIError, overloaded, unavailable
from service.metrics import RequestTimer
from service.protocol import SamplingParams

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
                prompt_param: str, max_param: str) -> int:
    """The number of tokens to generate: as asked, else default, else whatever room the context leaves."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise APIError(422, f"{prompt_param}: the prompt is {prompt_tokens} tokens, but the context is "
                            f"{max_model_len} tokens including at least one generated token",
                       param=prompt_param, code="context_length_exceeded")
    if max_new_tokens is None:
        return room if default is None else min(default, room)
    if max_new_tokens > room:
        raise APIError(422, f"{max_param}: prompt ({prompt_tokens} tokens) + {max_param} ({max_new_tokens}) "
                            f"must be <= the context length {max_model_len}",
                       param=max_param, code="context_length_exceeded")
    return max_new_tokens


class Generation:
    """One admitted request. `await Generation.submit(...)` admits it (429 / 422 / 503 at once if the core
    refuses); batches() streams its outputs, timing each, and records its outcome exactly once when it ends."""

    def __init__(self, request: Request, endpoint: str, stream: RequestStream, prompt_tokens: int):
        self.request = request
        self.stream = stream
        self.engine_id = stream.request_id
        request.state.counted = True  # from here on the outcome is recorded by _finish(), not the error handler
        self.timer = stream.timer = RequestTimer(request.app.state.metrics, endpoint, prompt_tokens)
        self.outcome = "aborted"  # until the engine says it finished
        self.done = False

    @classmethod
    async def submit(cls, request: Request, endpoint: str, prompt_token_ids: list[int], params: SamplingParams,
                     adapter: str | None, prompt_param: str) -> "Generation":
        client = engine(request)
        # The client may reuse its X-Request-Id; the engine (and the OpenAI response id) needs a unique id.
        engine_id = f"{request.state.request_id}-{secrets.token_hex(4)}"
        try:
            stream = await client.add_request(engine_id, prompt_token_ids, params, adapter)
        except EngineOverloaded:
            raise overloaded() from None
        except RequestRejected as e:  # what the core can judge: the prompt against the model and KV cache
            raise APIError(422, f"{prompt_param}: {e}", param=prompt_param, code="invalid_value") from None
        except EngineDead:
            raise unavailable() from None
        return cls(request, endpoint, stream, len(prompt_token_ids))

    async def batches(self) -> AsyncIterator[list[TokenOutput]]:
        """The request's tokens, in lists of those that arrived since the last one was taken."""
        try:
            async for batch in self.stream.batches():
                if batch[-1].finished:
                    self.outcome = "success"
                yield batch
        except Exception:  # EngineStepError, or a bug; cancellation (client gone) is not an Exception
            self.outcome = "internal_error"
            raise
        finally:
            self.release()

    def release(self) -> None:
        """Ends the request once: aborts it in the core if it is still running, and records its outcome."""
        if self.done:
            return
        self.done = True
        self.request.app.state.engine.abort(self.engine_id)
        self.timer.finish(self.outcome)
        self.request.state.generation = (self.outcome, self.timer.prompt_tokens, self.timer.generated_tokens)

    async def collect(self) -> list[TokenOutput] | None:
        """All outputs, or None if the client disconnected first (the request is then aborted at once)."""
        async def run():
            return [out async for batch in self.batches() for out in batch]

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
        except EngineStepError as e:
            raise APIError(500, f"generation failed: {e}", code="engine_error") from None


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server delivers is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
