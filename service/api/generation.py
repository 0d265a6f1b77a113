"""What the TGI and OpenAI routes share: fitting a prompt into the context, submitting it to the engine, timing
its tokens, and aborting it the moment its client goes away."""
import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

from service.api.errors import APIError, overloaded
from service.engine.async_engine import EngineOverloaded, EngineStepError, RequestRejected
from service.engine.outputs import TokenOutput
from service.engine.sampling_params import SamplingParams
from service.metrics import RequestTimer

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: str) -> str:
    return f"data: {data}\n\n"


class EventStream(StreamingResponse):
    """A server-sent event response for one generation, released even if the client left before the first
    event was produced (the body iterator then never starts, so its own cleanup never runs)."""

    def __init__(self, events: AsyncIterator[str], generation: "Generation"):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.generation.release()


def served_models(state) -> list[str]:
    """The base model's name, then the fine-tuned models (adapters) ready to serve."""
    finetune = state.finetune
    return [state.engine.model_name, *(finetune.served_models() if finetune is not None else [])]


def check_stop(stop: list[str], max_stop_sequences: int, param: str) -> None:
    if len(stop) > max_stop_sequences:
        raise APIError(422, f"{param}: at most {max_stop_sequences} stop sequences are allowed, got {len(stop)}",
                       param=param, code="invalid_value")


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
    """One admitted request. Creating it submits the request (429 / 422 at once if the engine refuses);
    tokens() streams its outputs, timing each, and records its outcome exactly once when it ends."""

    def __init__(self, request: Request, endpoint: str, prompt_token_ids: list[int], params: SamplingParams,
                 adapter: str | None, prompt_param: str):
        state = request.app.state
        self.request = request
        # The client may reuse its X-Request-Id; the engine needs a unique id.
        self.engine_id = f"{request.state.request_id}-{secrets.token_hex(4)}"
        try:
            self._stream = state.engine.add_request(self.engine_id, prompt_token_ids, params, adapter)
        except EngineOverloaded:
            raise overloaded() from None
        except RequestRejected as e:  # what the engine can judge: the prompt against the model and KV cache
            raise APIError(422, f"{prompt_param}: {e}", param=prompt_param, code="invalid_value") from None
        request.state.counted = True  # from here on the outcome is recorded by finish(), not the error handler
        self.timer = RequestTimer(state.metrics, endpoint, len(prompt_token_ids))
        self.outcome = "aborted"  # until the engine says it finished
        self.started = False

    async def tokens(self) -> AsyncIterator[TokenOutput]:
        self.started = True
        try:
            async with aclosing(self._stream) as stream:
                async for out in stream:
                    self.timer.on_token(out.queue_seconds)
                    if out.finished:
                        self.outcome = "success"
                    yield out
        except Exception:  # EngineStepError, or a bug; cancellation (client gone) is not an Exception
            self.outcome = "internal_error"
            raise
        finally:
            self._finish()

    def _finish(self) -> None:
        self.timer.finish(self.outcome)
        self.request.state.generation = (self.outcome, self.timer.prompt_tokens, self.timer.generated_tokens)

    async def release(self) -> None:
        """Aborts the request if nobody ever consumed its tokens; a no-op otherwise."""
        if not self.started:
            self.started = True
            await self.request.app.state.engine.abort(self.engine_id)
            self._finish()

    async def collect(self) -> list[TokenOutput] | None:
        """All outputs, or None if the client disconnected first (the request is then aborted at once)."""
        async def run():
            async with aclosing(self.tokens()) as tokens:
                return [out async for out in tokens]

        work = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(_disconnected(self.request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            await self.release()
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
