"""The engine for the HTTP server: a background asyncio task steps LLMEngine in a worker thread and fans the
tokens out to one asyncio.Queue per request."""
import asyncio
import logging
from typing import AsyncIterator, Callable

from service.config import Settings
from service.engine.llm_engine import EngineOverloaded, EngineStepError, LLMEngine, RequestRejected
from service.engine.outputs import StepStats, TokenOutput
from service.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineOverloaded", "EngineStepError", "RequestRejected"]
log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancels a background task and waits until it has unwound (its finally blocks ran)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.ready = False
        self._accepting = True
        self._queues: dict[str, asyncio.Queue] = {}
        self._listeners: list[Callable[[StepStats], None]] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> "AsyncEngine":
        return cls(LLMEngine(settings), settings.max_waiting_requests)

    # -- gauges ------------------------------------------------------------------------------------------
    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        self._listeners.append(fn)

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.create_task(self._loop(), name="engine-step-loop")
            self.ready = True

    async def shutdown(self, drain_seconds: float = 30.0) -> None:
        """Stops admitting, lets running requests finish for up to drain_seconds, fails the rest, stops."""
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + drain_seconds
        while self._queues and asyncio.get_running_loop().time() < deadline and self._task is not None:
            await asyncio.sleep(0.05)
        for request_id in list(self._queues):
            self.engine.abort(request_id)
            self._queues.pop(request_id).put_nowait(EngineStepError("the engine shut down", [request_id]))
        await cancel_and_wait(self._task)
        self._task = None
        self.ready = False

    async def _loop(self) -> None:
        while True:
            if not self.engine.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs, stats = await asyncio.to_thread(self.engine.step)
            except EngineStepError as e:
                for request_id in e.request_ids:
                    queue = self._queues.pop(request_id, None)
                    if queue is not None:
                        queue.put_nowait(e)
                continue
            except Exception:  # a bug outside the model step: keep serving the other requests
                log.exception("engine loop error")
                await asyncio.sleep(0.1)
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        del self._queues[out.request_id]
            if stats is not None:
                for fn in self._listeners:
                    try:
                        fn(stats)
                    except Exception:
                        log.exception("step listener failed")

    # -- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    adapter: str | None = None) -> AsyncIterator[TokenOutput]:
        if not self._accepting:
            raise EngineOverloaded("the engine is shutting down")
        if self.engine.num_waiting >= self.max_waiting_requests:
            raise EngineOverloaded(f"{self.engine.num_waiting} requests are already waiting")
        if request_id in self._queues:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self.engine.add_request(request_id, prompt_token_ids, params, adapter)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        if self._wakeup is not None:
            self._wakeup.set()
        return self._stream(request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[TokenOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away early: free the request's blocks now
                self._queues.pop(request_id, None)
                self.engine.abort(request_id)

    async def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        await asyncio.to_thread(self.engine.abort, request_id)
        if queue is not None:
            queue.put_nowait(EngineStepError("the request was aborted", [request_id]))
