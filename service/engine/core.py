"""The engine core: the process that owns the device, the model, the KV cache, the scheduler and sampler (through
LLMEngine) and the fine-tuning jobs. It runs one plain loop, with no asyncio: drain the front-ends' commands, step
the engine (or train a micro-batch between steps), and send each front-end one message per step with the new
tokens of all its requests. When there is nothing to do it blocks in poll: an idle server uses no CPU. It hands
two kinds of work to threads, lest the streams stall while it is done:
- compiling grammars (structured outputs, service.engine.grammar.CompileQueue): a request with a grammar waits
  (counted as waiting) until its grammar has compiled, then is admitted;
- reading LoRA adapters' files (tens of MB to GBs), on one reader thread that only turns a file into an Adapter:
  the loop puts it in the engine. The adapter calls (load, unload) take effect one at a time in the order they came,
  each answered once done, a load once its file is read: until then its name is not served, and requests for it
  are refused as when they come before the call. A request for a served adapter that max_cpu_loras let go waits
  (counted as waiting) while its file is read again, then is admitted.

Front-ends talk to it over ZeroMQ (service.protocol): the core binds a ROUTER socket, so every message names the
front-end it came from and every answer goes to that front-end alone.

With data parallelism (`data_parallel_size` > 1) the launcher starts several cores, each on its own device(s) and
address; `engine_index` labels a core's metrics. Core 0 alone runs the fine-tuning jobs (the front-ends send it
their calls); every core serves every LoRA adapter: the front-ends load and unload adapters on all of them
(service.api.engine_client.EngineClient.call_all), and a finished job's adapter, which core 0 serves, reaches the
others through one front-end (AdaptersChanged.published).

With kv_events_endpoint set, each core publishes its prefix cache's changes after every step that made some, for a
prefix-aware router (service.engine.kv_events).
"""
import contextlib
import logging
import signal
import socket
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import torch
import zmq
from prometheus_client import CollectorRegistry

from service.config import Settings
from service.engine.finetune_jobs import JobError, JobManager, finished_adapters
from service.engine.grammar import CompileQueue, GrammarError
from service.engine.kv_events import KVEventPublisher
from service.engine.llm_engine import AdapterError, AdapterNotServed, LLMEngine, RequestRejected
from service.metrics import EngineMetrics
from service.protocol import (
    Abort,
    AdaptersChanged,
    AddRequest,
    Admitted,
    Call,
    EngineInfo,
    Hello,
    Rejection,
    Reply,
    StepOutputs,
    choice_ids,
    core_decoder,
    encoder,
)

log = logging.getLogger(__name__)
GPU_MEMORY_INTERVAL = 1.0  # seconds between refreshes of the GPU memory gauges while steps run
LORA_INTERVAL = 1.0  # seconds between looks at the adapters of running and waiting requests while steps run


class EngineBroken(RuntimeError):
    """The device failed: the process must end so that its supervisor starts a fresh one."""


class EngineCore:
    def __init__(self, settings: Settings, address: str, registry: CollectorRegistry | None = None,
                 engine_index: int = 0):
        self.settings = settings
        self.engine = LLMEngine(settings)
        e = self.engine
        self.metrics = EngineMetrics(registry or CollectorRegistry(), engine_index, e.model_name, settings.block_size,
                                     e.kv_capacity_tokens // settings.block_size,
                                     settings.num_speculative_tokens if e.speculator is not None else 0)
        self.frontends: set[bytes] = set()
        for module in settings.lora_modules:  # every core serves them; one that cannot be served stops the start
            name, path = module.split("=", 1)
            try:
                e.load_adapter(name, path)
            except AdapterError as error:
                raise RuntimeError(f"lora_modules: cannot serve {module!r}: {error}") from None
        # One trainer: the other cores share finetune_dir but leave it alone, lest each resume its queued jobs.
        self.jobs = None if engine_index else JobManager(settings, e.model, e.model_name, self.metrics,
                                                          base=e.fingerprint, serve_adapter=self._publish)
        if engine_index:  # the adapters of core 0's finished jobs (core 0 logs those it cannot serve, and why)
            for name, path in finished_adapters(settings.finetune_dir).items():
                with contextlib.suppress(AdapterError):
                    e.load_adapter(name, path)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop a step's outputs for a busy front-end
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.kv_events = None
        if settings.kv_events_endpoint:  # before any request: the cache is empty
            e.scheduler.block_manager.record_events()
            self.kv_events = KVEventPublisher(self.context, settings.kv_events_endpoint, settings.kv_events_topic,
                                              engine_index, settings.block_size,
                                              "GPU" if e.device.type == "cuda" else "CPU", e.adapter_name)
        self._pack = encoder().encode
        self._unpack = core_decoder().decode
        self.owner: dict[str, bytes] = {}  # request id (each completion's, for n > 1) -> the front-end that sent it
        # stop() and finished grammar compiles (other threads) wake the poll through this pair.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self.compiles = CompileQueue(self.engine.grammars, settings.grammar_compile_timeout, self._wake)
        # Adapter files are read on this thread (one file at a time: the memory of one adapter in flight).
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="adapter-reader")
        self._read_adapter = e.adapter_reader()
        self._adapter_calls: deque[tuple[bytes, Call]] = deque()  # in arrival order; the first one is in progress
        self._loading: Future | None = None  # the read of the first adapter call's file, a load's
        self._rereads: dict[str, Future] = {}  # adapter key -> the read of the file of an adapter let go
        self._parked: dict[str, tuple[str, bytes, AddRequest, object]] = {}  # request id -> (key, front-end,
        # request, its compiled grammar or None): admitted once the file of adapter `key` is read again
        self._stopping = False
        self._gpu_memory_at = 0.0
        self._loras_at = 0.0
        self._record_load()
        self._record_gpu_memory()

    def info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(e.model_name, str(e.model_dir), e.max_model_len, e.model.config.vocab_size,
                          e.kv_capacity_tokens, e.served_adapters())

    def _train_in(self) -> float | None:
        """Seconds until the next fine-tuning micro-batch is due (0: now); None when no job runs here."""
        return None if self.jobs is None else self.jobs.seconds_until_work(time.perf_counter())

    # -- the loop ----------------------------------------------------------------------------------------
    def run(self, lifeline=None) -> None:
        """Serves until stop(), or until `lifeline` (the read end of a pipe whose write end the launcher holds)
        closes: the launcher stops the core after its front-ends have drained, or by dying."""
        if threading.current_thread() is threading.main_thread():
            # A signal to the whole process group (Ctrl-C, `kill -- -PGID`) must not stop the core before the
            # front-ends have drained their requests: the launcher decides, through the lifeline.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if lifeline is not None:
            poller.register(lifeline.fileno(), zmq.POLLIN)
        log.info("engine core serving %s", self.engine.model_name)
        try:
            while not self._stopping:
                train_in = self._train_in()
                if self.engine.has_work:
                    timeout = 0
                else:
                    waits = [t for t in (train_in, self.compiles.seconds_to_deadline()) if t is not None]
                    timeout = min(waits) * 1000 if waits else None
                events = dict(poller.poll(timeout))
                if lifeline is not None and lifeline.fileno() in events:
                    break
                if self._wake_r in events:
                    self._wake_r.recv(4096)
                if self.socket in events:
                    self._drain()
                if self.compiles:
                    self._admit_compiled()
                self._install_reads()
                if self.engine.has_work:
                    self._step()
                if self._train_in() == 0:
                    self.jobs.train_step(engine_busy=self.engine.has_work)
        finally:
            self._reader.shutdown(wait=False, cancel_futures=True)
            self.engine.grammars.shutdown()
            self.engine.close()
            if self.jobs is not None:
                self.jobs.shutdown()
            self.socket.close()
            if self.kv_events is not None:
                self.kv_events.close()
            self.context.term()
            log.info("engine core stopped")

    def stop(self) -> None:
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except BlockingIOError:  # already woken
            pass

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled, those whose grammar is compiling or adapter is read included."""
        return self.engine.num_waiting + len(self.compiles) + len(self._parked)

    def _send(self, identity: bytes, message) -> None:
        self.socket.send_multipart([identity, self._pack(message)], copy=False)

    def _drain(self) -> None:
        admitted: dict[bytes, Admitted] = defaultdict(lambda: Admitted([], []))
        while True:
            try:
                identity, payload = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                message = self._unpack(payload.buffer)
            except msgspec.DecodeError:
                log.error("dropped a malformed message from %r", bytes(identity.bytes))
                continue
            identity = identity.bytes
            if isinstance(message, AddRequest):
                self._add(identity, message, admitted[identity])
            elif isinstance(message, Abort):
                for request_id in message.request_ids:
                    if self.owner.pop(request_id, None) is not None:
                        self.engine.abort(request_id)
                    elif self._parked.pop(request_id, None) is None:  # its client left while its adapter was read
                        self.compiles.remove(request_id)  # or while its grammar compiled
            elif isinstance(message, Call):
                self._call(identity, message)
            elif isinstance(message, Hello):
                self.frontends.add(identity)
                self._send(identity, self.info())
        for identity, answer in admitted.items():
            self._send(identity, answer)
        self._record_load()

    def _add(self, identity: bytes, request: AddRequest, answer: Admitted) -> None:
        rid = request.request_id
        if self._stopping or self.num_waiting >= self.settings.max_waiting_requests:
            answer.rejected.append(Rejection(rid, "overloaded", f"{self.num_waiting} requests are waiting"))
            return
        grammar = request.params.grammar
        try:
            if grammar is not None:
                self.engine.validate(request.prompt_token_ids, request.params, request.adapter)
                if len(grammar.value.encode()) > self.settings.max_grammar_bytes:  # as the front-ends count it
                    raise GrammarError(f"longer than {self.settings.max_grammar_bytes} bytes (max_grammar_bytes)")
                self.compiles.add(grammar, rid, (identity, request))
                return  # admitted (or refused) once compiled
        except AdapterNotServed as e:  # unloaded before this front-end heard of it
            answer.rejected.append(Rejection(rid, "adapter", str(e)))
            return
        except RequestRejected as e:
            answer.rejected.append(Rejection(rid, "invalid", str(e)))
            return
        except GrammarError as e:
            answer.rejected.append(Rejection(rid, "grammar", str(e)))
            return
        self._admit(identity, request, None, answer)

    def _admit(self, identity: bytes, request: AddRequest, grammar, answer: Admitted) -> None:
        """Queues the request in the engine, or parks it while its adapter's file is read again (on the reader
        thread: the engine would read it on this one)."""
        rid = request.request_id
        try:
            reread = self.engine.adapter_to_read(request.adapter)
            if reread is not None:
                self.engine.validate(request.prompt_token_ids, request.params, request.adapter)
                key, path = reread
                self._parked[rid] = key, identity, request, grammar
                if key not in self._rereads:
                    self._rereads[key] = self._reader.submit(self._read_adapter, path)
                    self._rereads[key].add_done_callback(lambda _: self._wake())
                return
            self.engine.add_request(rid, request.prompt_token_ids, request.params, request.adapter,
                                    grammar=grammar, group=request.group)
        except AdapterNotServed as e:  # unloaded before this front-end heard of it, or while it waited
            answer.rejected.append(Rejection(rid, "adapter", str(e)))
            return
        except RequestRejected as e:
            answer.rejected.append(Rejection(rid, "invalid", str(e)))
            return
        self._accept(identity, request, answer)

    def _accept(self, identity: bytes, request: AddRequest, answer: Admitted) -> None:
        for rid in choice_ids(request.request_id, request.params.n):
            self.owner[rid] = identity
        answer.accepted.append(request.request_id)

    def _admit_compiled(self) -> None:
        """Admits the requests whose grammar has compiled (and fits), refuses those whose grammar did not."""
        admitted: dict[bytes, Admitted] = defaultdict(lambda: Admitted([], []))
        ready, refused = self.compiles.poll()
        for (identity, request), reason in refused:
            admitted[identity].rejected.append(Rejection(request.request_id, "grammar", reason))
        for (identity, request), compiled in ready:
            self._admit(identity, request, compiled, admitted[identity])
        for identity, answer in admitted.items():
            self._send(identity, answer)

    def _install_reads(self) -> None:
        """Puts in the engine the adapters whose files the reader thread has read: answers a load, and admits (or
        refuses) the requests that waited for an adapter read again."""
        if self._loading is not None and self._loading.done():
            (identity, call), read, self._loading = self._adapter_calls.popleft(), self._loading.result, None
            self._send_adapter_reply(identity, self._answer(call, lambda: self.engine.install_adapter(
                call.kwargs["name"], call.kwargs["path"], read)))
            self._run_adapter_calls()
        admitted: dict[bytes, Admitted] = defaultdict(lambda: Admitted([], []))
        for key, future in [(key, future) for key, future in self._rereads.items() if future.done()]:
            del self._rereads[key]
            waiting = [(rid, parked) for rid, parked in self._parked.items() if parked[0] == key]
            for rid, _ in waiting:
                del self._parked[rid]
            try:
                self.engine.install_read(key, future.result)
            except RequestRejected as e:
                for rid, (_, identity, _, _) in waiting:
                    admitted[identity].rejected.append(Rejection(rid, "invalid", str(e)))
                continue
            for _, (_, identity, request, grammar) in waiting:  # a request may meet its adapter unloaded now
                self._admit(identity, request, grammar, admitted[identity])
            self.engine.evict_adapters()  # after the admissions: their adapter is in use, and stays
        for identity, answer in admitted.items():
            self._send(identity, answer)

    def _call(self, identity: bytes, call: Call) -> None:
        if call.method in ("load_adapter", "unload_adapter"):
            self._adapter_calls.append((identity, call))
            self._run_adapter_calls()
        elif call.method == "stats":
            e = self.engine
            self._send(identity, Reply(call.call_id, {
                "running": e.num_running, "waiting": self.num_waiting, "kv_usage": e.kv_usage,
                "requests": len(e.requests), "owned": len(self.owner)}))
        elif call.method in JobManager.CALLS and self.jobs is not None:
            self._send(identity, self._answer(call, lambda: getattr(self.jobs, call.method)(**call.kwargs)))
        else:
            self._send(identity, Reply(call.call_id, error={"status": 404, "message": f"no call {call.method!r}",
                                                            "param": None, "code": None}))

    def _run_adapter_calls(self) -> None:
        """Carries out the adapter calls in order, up to a load: that one waits for its file (_install_reads)."""
        while self._adapter_calls and self._loading is None:
            identity, call = self._adapter_calls[0]
            if call.method == "load_adapter":
                # the result: the file to read, once the name is known to be free
                reply = self._answer(call, lambda: self.engine.check_adapter_name(call.kwargs["name"])
                                     or call.kwargs["path"])
                if reply.error is None:
                    self._loading = self._reader.submit(self._read_adapter, reply.result)
                    self._loading.add_done_callback(lambda _: self._wake())
                    return
                self._adapter_calls.popleft()
                self._send(identity, reply)
            else:
                self._adapter_calls.popleft()
                self._send_adapter_reply(identity, self._answer(call, lambda: self.engine.unload_adapter(
                    **call.kwargs)))

    def _send_adapter_reply(self, identity: bytes, reply: Reply) -> None:
        """The reply to a load or unload; the front-ends hear of the change first (their routes, GET /v1/models)."""
        if reply.error is None:
            self._broadcast_adapters()
        self._send(identity, reply)

    def _answer(self, call: Call, run) -> Reply:
        """The reply to `call`, which run() carries out."""
        try:
            result = run()
        except (JobError, AdapterError) as e:
            return Reply(call.call_id, error=e.as_dict())
        except Exception as e:
            log.exception("call %s failed", call.method)
            return Reply(call.call_id, error={"status": 500, "message": f"{type(e).__name__}: {e}", "param": None,
                                              "code": "internal_error"})
        return Reply(call.call_id, result)

    def _step(self) -> None:
        outputs, stats = self.engine.step()
        by_owner = defaultdict(list)
        failed = False
        for out in outputs:
            identity = self.owner.get(out.request_id)
            if identity is None:  # aborted by its front-end after this token was made
                continue
            by_owner[identity].append(out)
            if out.finish_reason is not None or out.error is not None:
                del self.owner[out.request_id]
                failed |= out.error is not None and out.error_code is None  # not the client's grammar
        for identity, outs in by_owner.items():
            self._send(identity, StepOutputs(outs))
        if self.kv_events is not None:  # after the tokens: they are what clients wait for
            self.kv_events.publish(self.engine.scheduler.block_manager.take_events())
        if stats is not None:
            self.metrics.record_step(stats)
            if self.engine.speculator is not None:
                spec = self.engine.speculator.stats
                self.metrics.record_spec(spec.drafts, spec.draft_tokens, spec.accepted_tokens,
                                         spec.accepted_per_position, spec.proposer_failures)
        self.metrics.record_outputs(outputs)
        self._record_load()
        self._record_gpu_memory()
        if failed and not self.engine.healthy():
            raise EngineBroken("the device failed; exiting so that a fresh engine core takes over")

    def _record_load(self) -> None:
        e = self.engine
        self.metrics.record_load(e.num_running, self.num_waiting, e.kv_usage)
        now = time.monotonic()
        if e.has_work and now - self._loras_at < LORA_INTERVAL:
            return  # a step pays for no scan of the queues; once idle, the (empty) sets are recorded at once
        self._loras_at = now
        s, slots = e.scheduler, e.runner.slots
        self.metrics.record_loras(adapters(s.running, e.adapter_name), adapters(s.waiting, e.adapter_name),
                                  self.settings.max_loras)
        self.metrics.record_lora_counts(e.adapter_reads, slots.loads if slots else 0, slots.evictions if slots else 0)

    def _record_gpu_memory(self) -> None:
        now = time.monotonic()
        # The engine's device, not the host's: a CPU engine may run where CUDA is available (tests on a GPU host).
        if self.engine.device.type != "cuda" or now - self._gpu_memory_at < GPU_MEMORY_INTERVAL:
            return
        self._gpu_memory_at = now
        device = self.engine.device
        self.metrics.record_gpu_memory(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                                       torch.cuda.mem_get_info(device)[1])

    def _broadcast_adapters(self, published: dict[str, str] | None = None) -> None:
        """Tells every front-end the adapters served here; `published` (name: file, a finished fine-tuning job's)
        to one of them alone, which has the other cores load them."""
        names, leader = self.engine.served_adapters(), min(self.frontends, default=None)
        for identity in self.frontends:
            self._send(identity, AdaptersChanged(names, published if published and identity == leader else {}))

    def _publish(self, name: str, path: str) -> None:
        """Serves a finished fine-tuning job's adapter here and on the other cores (JobManager.serve_adapter)."""
        self.engine.load_adapter(name, path)
        self._broadcast_adapters({name: path})


def adapters(seqs, name) -> list[str]:
    """The adapters that these sequences use, each once, by the names they are served under (name(seq.adapter))."""
    return sorted({name(seq.adapter) for seq in seqs if seq.adapter is not None})
