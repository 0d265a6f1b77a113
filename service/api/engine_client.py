"""The HTTP front-end's handle on the engine core (another process, over ZeroMQ; see service.protocol).

The event loop reads the core's socket (a plain ZeroMQ socket: a reader callback drains every message waiting,
with no coroutine per message). Each StepOutputs message carries one new token for every running request of
this front-end; the reader turns the tokens into text here (detokenization and stop strings are the
front-end's work, off the engine's critical path), observes their inter-token latencies in one batch, aborts the
requests that hit a stop string, and wakes each request's consumer once. A consumer that fell behind takes all its
waiting tokens at once, so its HTTP writes batch up by themselves under load.

With data parallelism the front-end holds a connection to each engine core and routes each new request to one
of them (EngineClient._route: prefix affinity, bounded by load); everything about a request then goes to the core
that owns it. Fine-tuning calls go to core 0, the one core that trains; every core serves every LoRA adapter, and
loading or unloading one is a call to them all (call_all).

If a core goes away (its connection drops), every request in flight there fails with EngineDead and the front-end
reports not ready until that core answers again.
"""
import asyncio
import itertools
import logging
import time
import zlib
from array import array
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import zmq
from zmq.utils.monitor import parse_monitor_message

from service.metrics import FrontendMetrics, RequestTimer
from service.protocol import (
    Abort,
    AdaptersChanged,
    AddRequest,
    Admitted,
    Call,
    EngineInfo,
    Hello,
    Reply,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    choice_ids,
    encoder,
    frontend_decoder,
)
from service.text import TextStream, chat_text, encode_chat, load_tokenizer

log = logging.getLogger(__name__)
INLINE_TOKENIZE_CHARS = 4096  # a few hundred microseconds of tokenizing: cheaper than a hop to a thread
AFFINITY_BLOCKS = 4  # a prompt's first full KV blocks, up to this many, pick its core (see EngineClient._route)
AFFINITY_SLACK = 4  # requests by which a prompt's own core may exceed the least loaded before it is passed over


class EngineOverloaded(Exception):
    """The core's waiting queue is full, or this front-end is draining (HTTP 429)."""


class RequestRejected(ValueError):
    """The core refused the request: it can never be served as asked (HTTP 422)."""


class AdapterNotServed(RequestRejected):
    """The adapter the request names is not served (unloaded before this front-end heard of it: HTTP 404)."""


class GrammarRejected(RequestRejected):
    """The request's grammar (JSON schema, regex) does not compile (HTTP 400)."""


class EngineStepError(RuntimeError):
    """The request failed inside the engine (HTTP 500, or an error event in a stream)."""


class EngineDead(EngineStepError):
    """The engine core is gone."""


class GrammarDeadEnd(EngineStepError):
    """The request's grammar allowed no token at some point of its output (HTTP 400, or an error event)."""


class CallError(Exception):
    """A remote call refused by the core; carries the HTTP status, message, param and code. From call_all: also
    the cores where the call succeeded."""

    def __init__(self, error: dict):
        super().__init__(error["message"])
        self.error = error
        self.succeeded: list[CoreLink] = []


@dataclass
class TokenOutput:
    """One generated token as the routes see it."""
    token_id: int
    text: str  # the text this token completes (may be "" while a UTF-8 character is split)
    logprob: float | None
    special: bool
    index: int  # 0-based position among generated tokens
    choice: int = 0  # which of the request's completions (n > 1, or several prompts) it belongs to
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "eos_token" once finished
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    top_logprobs: list[tuple[int, float]] | None = None


class RequestStream:
    """One completion in flight: its text so far and the tokens its consumer has not taken yet. The consumer
    (service.api.generation) may share `ready` and `timer` among the completions of one request."""

    def __init__(self, request_id: str, text: TextStream, special_ids: set[int], engine: int = 0):
        self.request_id = request_id
        self.engine = engine  # the index of the engine core that runs it
        self.text = text
        self.special_ids = special_ids
        self.timer: RequestTimer | None = None
        self.choice = 0
        self.waiting: list[TokenOutput] = []
        self.ready = asyncio.Event()
        self.count = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.error: Exception | None = None

    def push(self, out: RequestOutput) -> bool:
        """Adds the core's token; returns True if it hit a stop string (the core must stop this request)."""
        piece, hit_stop = self.text.add(out.token_id)
        reason = "stop" if hit_stop else out.finish_reason
        if reason is not None and not hit_stop:
            piece += self.text.flush()
        self.waiting.append(TokenOutput(out.token_id, piece, out.logprob, out.token_id in self.special_ids,
                                        self.count, 0, reason is not None, reason, out.prompt_tokens,
                                        out.cached_prompt_tokens, out.top_logprobs))
        self.count += 1
        self.finished = reason is not None
        self.finish_reason = reason
        self.ready.set()
        return hit_stop

    def fail(self, error: Exception) -> None:
        self.error, self.finished = error, True
        self.ready.set()

    def take(self) -> list[TokenOutput]:
        """The tokens not taken yet, marked as completion `choice`: the consumer sets it when it takes the stream
        over, which may be after the first tokens arrived (a request of several prompts waits for all of them to
        be admitted)."""
        batch, self.waiting = self.waiting, []
        for out in batch:
            out.choice = self.choice
        return batch


class CoreLink:
    """This front-end's connection to one engine core, and what it has in flight there."""

    def __init__(self, index: int, address: str):
        self.index = index
        self.address = address
        self.info: EngineInfo | None = None
        self.streams: dict[str, RequestStream] = {}
        self.admissions: dict[str, tuple[asyncio.Future, list[int], SamplingParams]] = {}
        self.info_task: asyncio.Task | None = None
        self.socket: zmq.Socket | None = None  # a DEALER, and its monitor, once started
        self.monitor: zmq.Socket | None = None

    @property
    def load(self) -> int:
        """Completions this front-end has running in that core, and requests it is submitting there."""
        return len(self.streams) + len(self.admissions)


class EngineClient:
    def __init__(self, address: str | list[str], identity: str, metrics: FrontendMetrics, block_size: int = 16):
        """address: the engine core's ZeroMQ address, or the addresses of cores 0, 1, ... (data parallelism)."""
        self.cores = [CoreLink(i, a) for i, a in enumerate([address] if isinstance(address, str) else address)]
        self.identity = identity
        self.metrics = metrics
        self.block_size = block_size
        self.context = zmq.Context()
        self.tokenizer = None
        self.special_ids: set[int] = set()
        self.max_token_chars = 0
        self.accepting = True
        self._calls: dict[int, tuple[asyncio.Future, CoreLink]] = {}  # call id -> its answer, the core it went to
        self._publishing: set[asyncio.Task] = set()
        self._call_ids = itertools.count()
        self._tokenizer_dir: Path | None = None
        self._tokenizer_task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._pack = encoder().encode
        self._unpack = frontend_decoder().decode

    # -- what the routes read ----------------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo | None:
        """Core 0's: every core serves the same model."""
        return self.cores[0].info

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None and all(core.info is not None for core in self.cores)

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def served_models(self) -> list[str]:
        """The base model, then the adapters any core serves (all of them do, but while one loads or unloads)."""
        adapters = [name for core in self.cores if core.info is not None for name in core.info.adapters]
        return [self.info.model_name, *dict.fromkeys(adapters)]

    def may_fit(self, text: str) -> bool:
        """False when the text is certainly longer than the context: a check in constant time."""
        return len(text) <= self.max_model_len * self.max_token_chars

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; long texts are tokenized in a worker thread so the event loop keeps serving."""
        if len(text) < INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a chat (and its tools) through the model's template, its messages' text kept as text
        (service.text); raises ChatTemplateError."""
        args = {"tools": tools} if tools else {}
        if len(chat_text(messages, tools)) < INLINE_TOKENIZE_CHARS:
            return encode_chat(self.tokenizer, messages, add_generation_prompt=True, **args)
        return await asyncio.to_thread(encode_chat, self.tokenizer, messages, add_generation_prompt=True, **args)

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self, tokenizer_dir: Path | None = None) -> None:
        """Connects to the engine cores. tokenizer_dir: where the model's tokenizer is, when known before the cores
        say: it loads (seconds) while they start, not after."""
        self.loop = asyncio.get_running_loop()
        if tokenizer_dir is not None:
            self._tokenizer_dir = tokenizer_dir.resolve()
            self._tokenizer_task = self.loop.create_task(asyncio.to_thread(load_tokenizer, tokenizer_dir))
        for core in self.cores:
            core.socket = self.context.socket(zmq.DEALER)
            core.socket.setsockopt(zmq.ROUTING_ID, self.identity.encode())
            core.socket.setsockopt(zmq.SNDHWM, 0)
            core.socket.setsockopt(zmq.RCVHWM, 0)
            core.socket.setsockopt(zmq.LINGER, 0)
            core.monitor = core.socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            core.socket.connect(core.address)
            # ZeroMQ's descriptors signal edges: each callback reads until nothing is left.
            self.loop.add_reader(core.socket.FD, partial(self._receive, core))
            self.loop.add_reader(core.monitor.FD, partial(self._watch, core))
            self._watch(core)  # what happened before the readers were there

    async def close(self) -> None:
        for core in self.cores:
            self.loop.remove_reader(core.socket.FD)
            self.loop.remove_reader(core.monitor.FD)
            if core.info_task is not None:
                core.info_task.cancel()
            core.socket.disable_monitor()
            core.monitor.close()
            core.socket.close()
        self.context.term()

    def drain(self, seconds: float) -> None:
        """Stops admitting (429, /health 503) and gives the requests in flight `seconds` to finish; those still
        running then end with an error (an error event in a stream, a 500 otherwise), before the server closes
        their connections."""
        self.accepting = False
        self._ready.set()  # a signal during startup: no core to wait for any more (one may have died loading)
        asyncio.get_running_loop().call_later(seconds, self.fail_all,
                                              EngineStepError("the server shut down before the request finished"))

    def fail_all(self, error: Exception) -> None:
        """Ends every request in flight (and every pending admission or call) with `error`."""
        for core in self.cores:
            self._fail(core, error)

    def _fail(self, core: CoreLink, error: Exception) -> None:
        """Ends what this front-end has in flight on one core with `error`."""
        for stream in core.streams.values():
            stream.fail(error)
        core.streams.clear()
        futures = [future for future, _, _ in core.admissions.values()]
        core.admissions.clear()
        lost = [call_id for call_id, (_, to) in self._calls.items() if to is core]
        futures += [self._calls.pop(call_id)[0] for call_id in lost]
        for future in futures:
            if not future.done():
                future.set_exception(error)

    def _watch(self, core: CoreLink) -> None:
        """Says hello whenever a core's socket connects; fails what is in flight there when it drops."""
        while core.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(core.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                self._send(core, Hello())
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                if core.info is not None:
                    log.error("lost engine core %d: failing %d requests in flight", core.index, len(core.streams))
                core.info = None
                self._fail(core, EngineDead("the engine core stopped"))

    def _send(self, core: CoreLink, message) -> None:
        core.socket.send(self._pack(message), copy=False)
        # A send may consume the descriptor's edge for messages already waiting: read them now.
        self.loop.call_soon(self._receive, core)

    # -- requests ----------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          adapter: str | None = None, group: str = "") -> list[RequestStream]:
        """Admits a request into a core (_route): the streams of its params.n completions, or EngineOverloaded /
        RequestRejected (GrammarRejected) / EngineDead. group: see AddRequest."""
        if not self.accepting:
            raise EngineOverloaded("the server is shutting down")
        if not self.ready:
            raise EngineDead("the engine core is not running")
        if any(request_id in core.streams or request_id in core.admissions for core in self.cores):
            raise RequestRejected(f"request id {request_id!r} is already in use")
        core = self._route(prompt_token_ids, adapter)
        admitted = asyncio.get_running_loop().create_future()
        core.admissions[request_id] = (admitted, prompt_token_ids, params)
        self._send(core, AddRequest(request_id, prompt_token_ids, params, adapter, group))
        try:
            return await admitted
        finally:
            core.admissions.pop(request_id, None)
            if admitted.cancelled():  # its client left before the core answered (a grammar compiling, say)
                self._send(core, Abort([request_id]))

    def _route(self, prompt_token_ids: list[int], adapter: str | None) -> CoreLink:
        """The core for a new request. Its prompt's first full KV blocks (AFFINITY_BLOCKS of them, or all a
        shorter prompt has) hash to a core: prompts that begin alike meet in one core's prefix cache, in every
        front-end alike. That core is passed over for the least loaded one when it is much more loaded: by more
        than AFFINITY_SLACK requests and by more than half the least loaded core's load. A prompt shorter than a
        block goes to the least loaded core. Load is what this front-end has in flight on a core: the kernel
        spreads connections evenly over the front-ends, so each balancing its own share balances the cores, and
        a core that runs slowly (long prompts, a fine-tuning job) holds its requests longer and so gets fewer.
        A request for an adapter goes to a core that serves it: every core does, but while one loads or unloads it,
        and while the other cores load a fine-tuning job's adapter, which core 0 serves first."""
        cores = self.cores
        if adapter is not None:
            cores = [core for core in cores if core.info is not None and adapter in core.info.adapters] or cores
        if len(cores) == 1:
            return cores[0]
        least = min(cores, key=lambda core: core.load)
        blocks = min(len(prompt_token_ids) // self.block_size, AFFINITY_BLOCKS)
        if blocks == 0:
            return least
        prefix = array("q", prompt_token_ids[:blocks * self.block_size]).tobytes()
        home = cores[zlib.crc32(prefix) % len(cores)]  # the same in every process, unlike hash()
        if home.load - least.load > max(AFFINITY_SLACK, least.load // 2):
            return least
        return home

    def abort(self, request_id: str) -> None:
        """Stops a request the client no longer wants; its KV blocks are freed in its core's next drain."""
        for core in self.cores:
            if core.streams.pop(request_id, None) is not None:
                self._send(core, Abort([request_id]))
                return

    async def call(self, method: str, **kwargs):
        """A remote call into core 0, the one that keeps the fine-tuning files and runs the jobs; raises
        CallError with the HTTP error."""
        return await self._call(self.cores[0], method, kwargs)

    async def call_all(self, method: str, cores: list[CoreLink] | None = None, **kwargs) -> list:
        """The call on every core (or on `cores`) at once: their results, in order. If it fails on any, the first
        failure: EngineDead, or a CallError whose `succeeded` lists the cores where the call did succeed."""
        cores = self.cores if cores is None else cores
        results = await asyncio.gather(*(self._call(core, method, kwargs) for core in cores), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                if isinstance(result, CallError):
                    result.succeeded = [core for core, r in zip(cores, results) if not isinstance(r, BaseException)]
                raise result
        return results

    async def _call(self, core: CoreLink, method: str, kwargs: dict):
        if not self.ready:
            raise EngineDead("the engine core is not running")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (future, core)
        self._send(core, Call(call_id, method, kwargs))
        return await future

    # -- what the cores send -----------------------------------------------------------------------------
    def _receive(self, core: CoreLink) -> None:
        while core.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            message = self._unpack(core.socket.recv(copy=False))
            if isinstance(message, StepOutputs):
                self._on_step(core, message.outputs)
            elif isinstance(message, Admitted):
                self._on_admitted(core, message)
            elif isinstance(message, Reply):
                future, _ = self._calls.pop(message.call_id, (None, None))
                if future is not None and not future.done():
                    if message.error is None:
                        future.set_result(message.result)
                    else:
                        future.set_exception(CallError(message.error))
            elif isinstance(message, AdaptersChanged):
                if core.info is not None:
                    core.info.adapters = message.adapters
                if message.published:  # this front-end was chosen to have the other cores load them
                    task = self.loop.create_task(self._publish(core, message.published))
                    self._publishing.add(task)  # the loop keeps only a weak reference
                    task.add_done_callback(self._publishing.discard)
            elif isinstance(message, EngineInfo):
                core.info_task = self.loop.create_task(self._on_info(core, message))

    async def _on_info(self, core: CoreLink, info: EngineInfo) -> None:
        if self.tokenizer is None:
            # Once, off the event loop, and only once however many cores answer meanwhile.
            model_dir = Path(info.model_dir).resolve()
            if self._tokenizer_task is None or self._tokenizer_dir != model_dir:
                self._tokenizer_dir = model_dir
                self._tokenizer_task = self.loop.create_task(asyncio.to_thread(load_tokenizer, info.model_dir))
            tokenizer = await self._tokenizer_task
            if self.tokenizer is None:
                self.special_ids = set(tokenizer.all_special_ids)
                # No token stands for more characters than its longest spelling: a text longer than this many per
                # token of context cannot fit, and is refused without tokenizing it.
                self.max_token_chars = max(map(len, tokenizer.get_vocab()))
                self.tokenizer = tokenizer
        core.info = info
        self.metrics.attach(info.model_name, core.index)
        log.info("attached to engine core %d serving %s", core.index, info.model_name)
        if self.ready:
            self._ready.set()

    async def _publish(self, source: CoreLink, adapters: dict[str, str]) -> None:
        """Has every core but `source` load the adapters (name: file) of fine-tuning jobs that finished there."""
        others = [core for core in self.cores if core is not source]
        for name, path in adapters.items():
            try:
                await self.call_all("load_adapter", others, name=name, path=path)
            except (CallError, EngineDead) as e:
                log.error("the other engine cores cannot serve adapter %s (%s): %s", name, path, e)

    async def wait_ready(self) -> None:
        """Returns once every engine core has answered and the tokenizer is loaded, or once draining."""
        await self._ready.wait()

    def _on_admitted(self, core: CoreLink, message: Admitted) -> None:
        for request_id in message.accepted:
            future, prompt_token_ids, params = core.admissions.pop(request_id, (None, None, None))
            if future is None or future.done():  # its client left meanwhile
                self._send(core, Abort(choice_ids(request_id, params.n) if params else [request_id]))
                continue
            # The streams exist before this task reads the request's first token. The core checked the prompt's
            # token ids: only now may the decoder see them.
            streams = []
            for choice_id in choice_ids(request_id, params.n):
                text = TextStream(self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output)
                streams.append(RequestStream(choice_id, text, self.special_ids, core.index))
                core.streams[choice_id] = streams[-1]
            future.set_result(streams)
        for rejection in message.rejected:
            future, _, _ = core.admissions.pop(rejection.request_id, (None, None, None))
            if future is not None and not future.done():
                error = {"overloaded": EngineOverloaded, "grammar": GrammarRejected,
                         "adapter": AdapterNotServed}.get(rejection.reason, RequestRejected)
                future.set_exception(error(rejection.message))

    def _on_step(self, core: CoreLink, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        gaps, stopped = [], []
        for out in outputs:
            stream = core.streams.get(out.request_id)
            if stream is None:  # aborted here after the core made this token
                continue
            if out.error is not None:
                stream.fail((GrammarDeadEnd if out.error_code == "invalid_grammar" else EngineStepError)(out.error))
            elif stream.push(out):
                stopped.append(out.request_id)
            if stream.timer is not None and out.error is None:
                stream.timer.on_tokens(now, 1, gaps, out.queue_seconds)
            if stream.finished:
                del core.streams[out.request_id]
        self.metrics.observe_gaps(core.index, gaps)
        if stopped:
            self._send(core, Abort(stopped))
