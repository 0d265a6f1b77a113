"""The synchronous engine: loads the model, and advances every live request one token per step through the
scheduler (which sequences, which KV blocks), the runner (forward inputs, the model, the KV cache) and the
sampler. The engine core process and the offline LLM drive it; it knows token ids only (text is the front-end's).

Steps overlap when async scheduling is on (the default on CUDA): step() schedules and launches step N+1 before it
waits for step N's sampled tokens, so the host's work for N+1 runs while the GPU computes N, and the only wait
is the copy of N's tokens. A request that ends in step N (EOS) has already been scheduled into N+1; that token is
dropped. Requests whose sampling needs the previous token on the host (the repetition, frequency and presence
penalties, grammars) sample late: step N+1's forward pass is launched first, then N's tokens are read and the
grammars' masks filled while it runs, then N+1 samples.

Speculative decoding (`speculative_method`, service.engine.speculative) runs the steps that propose synchronously:
proposals need every sequence's last token on the host, so such a step first completes the one in flight, and a
step that verifies completes at once. Before it the proposer drafts tokens for decoding sequences (a draft model
runs its own steps for them: service.engine.draft_model); the step scores them, and verification appends the
accepted ones and the target's next token, all reported at once. Steps that do not propose (at
`speculative_disable_by_batch_size` sequences or more, or while every sequence backs off or cannot speculate) overlap
as without speculation.
"""
import functools
import gc
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from service.config import Settings
from service.engine.grammar import GrammarError, Grammars
from service.engine.model_runner import start_runner
from service.engine.sampler import Sampled, Sampler, on_device
from service.engine.scheduler import ScheduledBatch, Scheduler
from service.engine.sequence import PENDING, Sequence, Status
from service.engine.speculative import Speculator, make_proposer
from service.engine.tp_workers import Workers
from service.model import peft
from service.model.config import ModelConfig
from service.model.fingerprint import fingerprint
from service.model.loader import eos_token_ids, load_model, resolve_dtype, resolve_model_dir
from service.model.lora import Adapter, AdapterMismatch, add_adapter, has_adapter, remove_adapter
from service.model.parallel import SINGLE, TensorParallel, check_divisible
from service.protocol import MAX_TOP_K, RequestOutput, SamplingParams, choice_ids, choice_seed

log = logging.getLogger(__name__)
STEP_FAILED = "the engine failed to compute this request's step (the server's log has the details)"
GRAMMAR_DEAD_END = ("the grammar allows no token at this point of the output: it can never be completed (a $ref "
                    "that recurses with no way out, say)")


class RequestRejected(ValueError):
    """The request can never be served: prompt too long, cannot fit the cache, bad parameters (HTTP 422)."""


class EngineStepError(RuntimeError):
    """A step failed; the offline LLM raises it for the requests of that step (HTTP 500 when served)."""


class AdapterNotServed(RequestRejected):
    """The request names an adapter that is not served, or no longer (HTTP 404)."""


class AdapterError(Exception):
    """An adapter cannot be loaded or unloaded as asked: the HTTP status, message, the field at fault and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def as_dict(self) -> dict:
        return {"status": self.status, "message": self.message, "param": self.param, "code": self.code}


@dataclass
class StepStats:
    """What one engine step did; the metrics layer turns these into Prometheus series."""
    step_seconds: float
    batch_size: int  # sequences in the step
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float  # 0..1
    num_preemptions: int  # in this step
    prefix_queried_tokens: int  # in this step
    prefix_hit_tokens: int
    kind: str = "eager"  # how the runner ran the step launched: service.metrics.STEP_KINDS
    adapters: str = "none"  # whose LoRA adapters it served: none, slots (in the graphs) or hooks (eager)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet."""
    batch: ScheduledBatch
    sampled: Sampled | None
    seqs: list[Sequence]  # the sequences it samples, in row order
    positions: list[int]  # where each one's PENDING token sits in its token_ids
    verified: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # speculative: each one's new tokens


def _stop_reason(params: SamplingParams, token: int, eos: set[int]) -> str | None:
    """"stop" for one of the request's stop tokens, "eos_token" for EOS unless it ignores EOS, else None."""
    if token in params.stop_token_ids:
        return "stop"
    if token in eos and not params.ignore_eos:
        return "eos_token"
    return None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    def __init__(self, settings: Settings):
        self.settings = s = settings
        self.model_dir = resolve_model_dir(s.model)
        cfg = ModelConfig.from_dir(self.model_dir)
        self.device = resolve_device(s.device)
        dtype = resolve_dtype(s.dtype, cfg, self.device)
        local = s.model is None or self.model_dir == Path(s.model)
        self.model_name = s.served_model_name or (self.model_dir.resolve().name if local else s.model)
        self.max_model_len = min(s.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        log.info("loading %s (%s, %s) on %s", self.model_dir, cfg.architecture, dtype, self.device)
        self.workers, tp = None, SINGLE
        if s.tensor_parallel_size > 1:
            check_divisible(cfg, s.tensor_parallel_size)  # before any process starts
            self.workers = Workers(s, self.model_dir, dtype, self.device, self.max_model_len)
            tp = TensorParallel.current()
        self._broken = False
        start = time.perf_counter()
        self.model = load_model(self.model_dir, dtype, self.device, tp)
        # Start-up time is a target (a warm restart's first token within seconds): say where it goes.
        log.info("model loaded in %.1fs", time.perf_counter() - start)
        # Token ids only: the tokenizer itself (transformers' imports take seconds) loads when a grammar needs it.
        self.eos_token_ids = eos_token_ids(self.model_dir)
        # A draft model takes its weights and KV cache first: the target's cache is sized from the memory left.
        proposer = None
        if s.speculative_method is not None:
            proposer = make_proposer(s, self.device, dtype, self.max_model_len, cfg)
        self.runner = start_runner(self.model, s, self.max_model_len)
        self.runner.workers = self.workers
        num_blocks = self.runner.kv_cache.num_blocks
        # A step with decodes fits the largest prefill graph, if that leaves prompts room beside a full decode batch.
        graph_tokens = max((t for t, _ in self.runner.prefill_graphs), default=0)
        mixed = s.max_mixed_step_tokens or (graph_tokens if graph_tokens >= 2 * s.max_num_seqs
                                            else s.max_num_batched_tokens)
        hold = s.admission_hold_steps
        if hold is None:
            hold = 8 if self.device.type == "cuda" else 0
        self.scheduler = Scheduler(num_blocks, s.block_size, s.enable_prefix_caching, s.max_num_seqs,
                                   s.max_num_batched_tokens, self.max_model_len, mixed, hold, s.max_loras,
                                   s.scheduling_policy)
        self.sampler = Sampler()
        self.grammars = Grammars(self.model_dir, cfg.vocab_size, sorted(self.eos_token_ids), s.grammar_cache_bytes,
                                 pin_memory=self.device.type == "cuda")
        self.requests: dict[str, Sequence] = {}
        # LoRA adapters (load_adapter): the registry key (model.lora_adapters) of each served name; the name and file
        # of each key, least recently used first (max_cpu_loras); the sequences alive per key; the keys unloaded
        # while sequences used them, removed when the last one ends; every key a load ever had.
        self._adapter_keys: dict[str, str] = {}
        self._sources: dict[str, tuple[str, str]] = {}
        self._adapter_users: dict[str, int] = {}
        self._retired: set[str] = set()
        self._used_keys: set[str] = set()
        self._versions = itertools.count(1)
        self._fingerprint: dict | None = None
        self.adapter_reads = 0  # adapter files read into memory (loads, and reloads after max_cpu_loras let go)
        self.speculator = None
        if proposer is not None:
            self.speculator = Speculator(proposer, s.num_speculative_tokens, s.speculative_disable_by_batch_size,
                                         self.max_model_len, s.speculative_min_acceptance)
        self.overlap = s.async_scheduling if s.async_scheduling is not None else self.device.type == "cuda"
        self._in_flight: _InFlight | None = None
        # Weights' metadata, the tokenizer and compiled kernels live as long as the engine: freezing them keeps
        # the garbage collector from rescanning them in pauses between steps.
        gc.collect()
        gc.freeze()

    @property
    def kv_capacity_tokens(self) -> int:
        bm = self.scheduler.block_manager
        return bm.num_blocks * bm.block_size

    # -- requests ----------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None = None) -> None:
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        if params.max_new_tokens < 1:
            raise RequestRejected("max_new_tokens must be >= 1")
        if not (0 <= params.temperature < math.inf and 0 < params.top_p <= 1 and 0 <= params.top_k <= MAX_TOP_K
                and 0 < params.repetition_penalty < math.inf and 0 <= params.min_p <= 1):
            raise RequestRejected(f"need 0 <= temperature < inf, 0 < top_p <= 1, 0 <= top_k <= {MAX_TOP_K}, "
                                  "0 < repetition_penalty < inf, 0 <= min_p <= 1")
        if not (-2 <= params.frequency_penalty <= 2 and -2 <= params.presence_penalty <= 2):
            raise RequestRejected("frequency_penalty and presence_penalty must be in [-2, 2]")
        if any(not 0 <= t < vocab or not -100 <= b <= 100 for t, b in params.logit_bias.items()):
            raise RequestRejected(f"logit_bias: token ids must be in [0, {vocab}) and biases in [-100, 100]")
        if not 0 <= params.min_tokens <= params.max_new_tokens:
            raise RequestRejected("min_tokens must be in [0, max_new_tokens]")
        if params.seed is not None and not -2**63 <= params.seed < 2**64:
            raise RequestRejected("seed must be in [-2**63, 2**64)")
        if params.top_logprobs < 0 or params.top_logprobs > 20:
            raise RequestRejected("top_logprobs must be in 0..20")
        if params.priority and self.settings.scheduling_policy != "priority":
            raise RequestRejected(f"priority {params.priority}: the server does not schedule by priority "
                                  "(scheduling_policy fcfs)")
        if not 1 <= params.n <= self.settings.max_num_seqs:
            raise RequestRejected(f"n must be in [1, {self.settings.max_num_seqs}] (the most sequences in a step)")
        total = len(prompt_token_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise RequestRejected(f"prompt ({len(prompt_token_ids)} tokens) + max_new_tokens "
                                  f"({params.max_new_tokens}) exceeds the context length {self.max_model_len}")
        if total > self.kv_capacity_tokens:
            raise RequestRejected(f"prompt + max_new_tokens ({total}) exceeds the KV cache "
                                  f"({self.kv_capacity_tokens} tokens)")
        if adapter is not None and self._adapter_key(adapter) is None:
            raise AdapterNotServed(f"unknown adapter {adapter!r}: not served (GET /v1/models lists those that are)")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    adapter: str | None = None, grammar=None, group: str = "") -> None:
        """Queues a request: its params.n completions, with ids choice_ids(request_id, n). grammar: the compiled
        params.grammar, when the caller compiled it (the engine core does, on worker threads); otherwise it is
        compiled here. group: whose share of a step it counts against (the scheduler's fairness); "": its own."""
        ids = choice_ids(request_id, params.n)
        if any(i in self.requests for i in ids):
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params, adapter)
        if params.grammar is not None and grammar is None:
            try:
                grammar = self.grammars.compile(params.grammar).result()
            except GrammarError as e:
                raise RequestRejected(f"grammar: {e}") from None
        key = None if adapter is None else self._adapter_key(adapter)  # the version served now, for its whole life
        if key is not None:
            self._touch(key)
        seqs = []
        for i, rid in enumerate(ids):
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device).manual_seed(choice_seed(params.seed, i))
            seq = Sequence(rid, list(prompt_token_ids), params, generator, key, group or request_id)
            if grammar is not None:
                seq.matcher, seq.grammar = self.grammars.matcher(grammar), grammar
                self.grammars.hold(grammar)
            self.requests[rid] = seq
            seqs.append(seq)
        if key is not None:
            self._adapter_users[key] = self._adapter_users.get(key, 0) + len(seqs)
        parent, *children = seqs
        for child in children:
            child.fork_of = parent
        parent.forks = children
        self.scheduler.add(parent)

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.grammar is not None:
            self.grammars.release(seq.grammar)
        self.scheduler.free(seq)  # a token of it still in flight is dropped when that step completes
        if self.speculator is not None:  # the proposer's state for it: a draft model's KV blocks
            self.speculator.release(seq)
        if seq.adapter is not None:
            self._release_adapter(seq.adapter)
        return True

    # -- LoRA adapters -----------------------------------------------------------------------------------
    # Reading an adapter's file (tens of MB, GBs for big models) would hold up every stream if the thread that steps
    # did it: the engine core reads files on a thread of its own with adapter_reader() and hands each Adapter to
    # install_adapter (a load) or install_read (one that max_cpu_loras let go, see adapter_to_read). The offline LLM
    # calls load_adapter, which does all of it here.
    def load_adapter(self, name: str, path: str) -> None:
        """Serves the adapter at path (a PEFT directory, or one of our .safetensors files) as model `name` from the
        next step on. AdapterError if it cannot be, and then what is served stays as it was."""
        self.install_adapter(name, path, functools.partial(self.adapter_reader(), path))

    def check_adapter_name(self, name: str) -> None:
        """AdapterError unless `name` is free to load an adapter under."""
        if name == self.model_name:
            raise AdapterError(400, f"{name!r} is the base model's name", "lora_name", "invalid_value")
        if self._adapter_key(name) is not None:
            raise AdapterError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name",
                               "adapter_exists")

    def adapter_reader(self) -> Callable[[str], Adapter]:
        """reader(path): the adapter file at path as the registry holds it (peft.load_adapter), or its error. It
        touches nothing of the engine's (the device, dtype and fingerprint are taken now): safe on another thread."""
        param = next(self.model.parameters())
        return functools.partial(peft.load_adapter, device=param.device, dtype=param.dtype, base=self.fingerprint)

    def install_adapter(self, name: str, path: str, read: Callable[[], Adapter]) -> None:
        """Serves as `name` the adapter that read() returns (or raises: the reader's, for path), as load_adapter.
        The engine core checks the name before it reads the file (check_adapter_name); it is checked again here:
        a fine-tuning job's adapter may have taken it meanwhile."""
        self.check_adapter_name(name)
        # Every load gets a key of its own: an unloaded version of the name may still run, and the prefix cache may
        # hold blocks computed with it, salted with its key.
        key = name
        while key in self._used_keys:
            key = f"{name} #{next(self._versions)}"
        try:
            self._add(key, read)
        except peft.AdapterNotFound as e:
            raise AdapterError(404, str(e), "lora_path", "adapter_not_found") from None
        except AdapterMismatch as e:
            made_for = peft.peft_base_model(path)
            raise AdapterError(400, f"{path} was made for another base model" + (
                f" ({made_for})" if made_for else "") + f": {e}", "lora_path", "adapter_mismatch") from None
        except peft.AdapterFileError as e:
            raise AdapterError(400, str(e), "lora_path", "invalid_adapter") from None
        self._adapter_keys[name] = key
        self._used_keys.add(key)
        self._sources[key] = name, path
        self.evict_adapters()
        log.info("serving adapter %s from %s", name, path)

    def adapter_to_read(self, name: str | None) -> tuple[str, str] | None:
        """(key, path) when `name` is served but max_cpu_loras let its weights go: a request for it needs them read
        from the file again first (install_read); None when none is needed (or `name` is not served)."""
        key = None if name is None else self._adapter_key(name)
        if key not in self._sources or has_adapter(self.model, key):
            return None
        return key, self._sources[key][1]

    def install_read(self, key: str, read: Callable[[], Adapter]) -> None:
        """Puts back in memory the weights of adapter `key` that read() returns (read from its file, see
        adapter_to_read), unless it was unloaded meanwhile; RequestRejected if they cannot be read. The caller
        admits the requests that waited for it, then calls evict_adapters."""
        if key not in self._sources or has_adapter(self.model, key):
            return
        try:
            self._add(key, read)
        except (peft.AdapterFileError, AdapterMismatch) as e:
            raise RequestRejected(f"the adapter cannot be loaded again from {self._sources[key][1]}: {e}") from None

    def unload_adapter(self, name: str) -> None:
        """Stops serving adapter `name`: new requests for it are refused at once; those running or waiting keep it
        to their end, and its weights go with the last of them."""
        key = self._adapter_keys.pop(name, None)
        if key is None:
            raise AdapterError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
        if key in self._adapter_users:
            self._retired.add(key)
        else:
            remove_adapter(self.model, key)
            del self._sources[key]
        log.info("unloaded adapter %s", name)

    def served_adapters(self) -> list[str]:
        """The names of the adapters served through load_adapter, oldest first."""
        return list(self._adapter_keys)

    def adapter_name(self, key: str) -> str:
        """The name a sequence's adapter (Sequence.adapter, a registry key) is, or was, served under."""
        return self._sources[key][0] if key in self._sources else key

    @property
    def fingerprint(self) -> dict:
        """The base model's (service.model.fingerprint), which our own adapter files must carry."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.model)
        return self._fingerprint

    def _adapter_key(self, name: str) -> str | None:
        """The registry key (model.lora_adapters) of the adapter served as `name`, None if none is. A request keeps
        the key it was admitted with: one of an adapter unloaded and loaded again under its name runs on the version
        it began with, and the prefix cache, salted with the key, never gives one load's KV to another."""
        key = self._adapter_keys.get(name)
        if key is None and has_adapter(self.model, name) and name not in self._retired \
                and name not in self._adapter_keys.values():
            key = name  # put in the registry directly (add_adapter: the offline LLM, tests)
        return key

    def _release_adapter(self, key: str) -> None:
        users = self._adapter_users.pop(key) - 1
        if users:
            self._adapter_users[key] = users
        elif key in self._retired:
            self._retired.discard(key)
            remove_adapter(self.model, key)
            del self._sources[key]
        else:
            self.evict_adapters()

    def _touch(self, key: str) -> None:
        """Marks a loaded adapter the most recently used, reading it again if max_cpu_loras let it go (here, on
        the stepping thread: the engine core reads it beforehand on its own, see adapter_to_read); RequestRejected
        if it cannot be."""
        source = self._sources.pop(key, None)
        if source is None:  # put in the registry directly: always there
            return
        self._sources[key] = source
        if not has_adapter(self.model, key):
            self.install_read(key, functools.partial(self.adapter_reader(), source[1]))
            self.evict_adapters(keep=key)

    def _add(self, key: str, read: Callable[[], Adapter]) -> None:
        """Puts the adapter that read() returns in the registry under key."""
        add_adapter(self.model, key, read())
        self.adapter_reads += 1

    def evict_adapters(self, keep: str | None = None) -> None:
        """Lets the least recently used adapters that no sequence uses (nor `keep`) go, while more than
        max_cpu_loras are in memory; their files load them again when a request needs them."""
        limit = self.settings.max_cpu_loras
        if limit is None:
            return
        loaded = [key for key in self._sources if has_adapter(self.model, key)]
        excess = len(loaded) - limit
        for key in loaded:
            if excess <= 0:
                return
            if key not in self._adapter_users and key != keep:
                remove_adapter(self.model, key)
                excess -= 1

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.scheduler.kv_usage

    # -- stepping ----------------------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepStats | None]:
        """Launches the next step and returns the outputs of the step before it (overlapped), or of the step
        just launched (synchronous). A failing step fails its requests (outputs with `error`), not the engine."""
        start = time.perf_counter()
        outputs = []
        # Inference mode for the sampler too: it edits the logits in place, which are inference tensors.
        with torch.inference_mode():
            if self.speculator is not None:
                if self._in_flight is not None and self.speculator.drafting(self.scheduler.running):
                    outputs += self._complete()  # proposals read every sequence's last token
                self.speculator.propose(self.scheduler.running)
            batch = self.scheduler.schedule()
            launched = self._launch(batch, outputs) if batch.seqs else None
            if self._in_flight is not None:
                outputs += self._complete()
            self._in_flight = launched
            # A verify's tokens join their sequences when its step completes: before the next one is scheduled.
            if launched is not None and (not self.overlap or batch.drafts):
                outputs += self._complete()
        if not batch.seqs:
            return outputs, None
        kind, adapters = self.runner.last_step
        return outputs, StepStats(
            step_seconds=time.perf_counter() - start, batch_size=len(batch.seqs),
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=sum(batch.num_tokens) - batch.num_prefill_tokens,
            num_running=self.num_running, num_waiting=self.num_waiting, kv_usage=self.kv_usage,
            num_preemptions=batch.num_preemptions, prefix_queried_tokens=batch.prefix_queried_tokens,
            prefix_hit_tokens=batch.prefix_hit_tokens, kind=kind, adapters=adapters)

    def _launch(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> _InFlight | None:
        """Launches the batch's forward pass and sampling; completes the step in flight first when a sampled row
        needs its tokens (after launching the forward pass, which does not)."""
        pending = self._in_flight.sampled.token_ids if self._in_flight and self._in_flight.sampled else None
        try:
            logits, index, greedy = self.runner.run(batch, pending)
            verified = []
            if batch.drafts:  # a speculative step: the verified sequences' rows leave, the others are sampled
                logits, index, verified = self.speculator.verify(logits, index, batch.drafts, batch.seqs,
                                                                 None if greedy is None else greedy[0])
                greedy = None  # a decode graph's argmax covered the verified rows too
            seqs = [batch.seqs[i] for i in index]
            if batch.forks:  # each fork samples from its parent's row: the same prompt, its own draw
                rows = [seqs.index(parent) for _, parent in batch.forks]
                logits = torch.cat([logits, logits.index_select(0, on_device(rows, logits.device))])
                seqs += [child for child, _ in batch.forks]
            if not seqs:
                sampled = None
            elif all(s.argmax_only for s in seqs):  # one pass over the batch in the common case
                sampled = self.sampler.argmax(logits, any(s.params.logprobs for s in seqs),
                                              None if batch.forks else greedy)
            else:
                history = any(s.params.needs_history for s in seqs)
                if history and self._in_flight is not None:
                    outputs += self._complete()
                sampled = self._sample(logits, seqs, history, outputs)
        except Exception as e:
            outputs += self._fail(batch.seqs + [child for child, _ in batch.forks], e)
            return None
        positions = []
        for row, seq in enumerate(seqs):
            positions.append(len(seq.token_ids))
            seq.token_ids.append(PENDING)
            seq.pending_row = row
        return _InFlight(batch, sampled, seqs, positions, verified)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], history: bool,
                outputs: list[RequestOutput]) -> Sampled:
        banned = [self._banned(s) for s in seqs] if any(s.params.min_tokens for s in seqs) else None
        masks = None
        bound = [row for row, s in enumerate(seqs) if s.matcher is not None]
        if bound:
            json_rows = [i for i, row in enumerate(bound) if seqs[row].params.grammar.kind == "json"]
            words = self.grammars.fill_masks([seqs[row].matcher for row in bound], json_rows)
            # One pass over all rows' masks; a row's own checks only where it allows nothing or has bans (a
            # torch call and a matcher call per row cost the step's host tens of microseconds each 64 rows).
            allows = words.any(dim=1).tolist()
            for i, row in enumerate(bound):
                if not allows[i] or (banned and banned[row]):
                    self._check_mask(seqs[row], words[i], allows[i], banned[row] if banned else None, outputs)
            masks = words, bound
        return self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs],
                            [s.token_ids for s in seqs] if history else None,
                            [s.num_prompt_tokens for s in seqs] if history else None, banned, masks)

    def _check_mask(self, seq: Sequence, mask: torch.Tensor, allows_any: bool, banned: list[int] | None,
                    outputs: list[RequestOutput]) -> None:
        """A grammar row's mask (allows_any: whether it allows some token) beside its bans. A grammar that allows
        nothing but what min_tokens bans is complete: it wins, and the ban goes. One that allows nothing at all is
        at a dead end: the request ends with an error rather than a token the grammar refuses."""
        if seq.status is Status.FINISHED or seq.matcher.is_terminated():  # ended by the step before, say
            return
        if not allows_any:
            mask.fill_(-1)  # its token is dropped: keep the row's logits finite
            outputs.append(RequestOutput(seq.request_id, error=GRAMMAR_DEAD_END, error_code="invalid_grammar"))
            self.abort(seq.request_id)
        elif banned and not self.grammars.allows_any(mask, banned):
            banned.clear()

    def _banned(self, seq: Sequence) -> list[int]:
        """The tokens that would end seq before its min_tokens (its token ids hold every earlier token, the one
        still in flight as PENDING included)."""
        if len(seq.token_ids) - seq.num_prompt_tokens >= seq.params.min_tokens:
            return []
        ends = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_token_ids)
        return sorted(ends)

    def _complete(self) -> list[RequestOutput]:
        """Reads the in-flight step's tokens, fills them in, and reports them (finishing requests that end)."""
        done, self._in_flight = self._in_flight, None
        if done.sampled is None:
            return self._accept_verified(done.verified)
        try:
            tokens, logprobs, tops = done.sampled.fetch()
        except Exception as e:
            return self._fail(done.batch.seqs, e)
        outputs = []
        bound = [row for row, seq in enumerate(done.seqs) if seq.matcher is not None and seq.status != Status.FINISHED
                 and not seq.matcher.is_terminated()]
        accepted = dict(zip(bound, self.grammars.accept([done.seqs[row].matcher for row in bound],
                                                        [tokens[row] for row in bound]))) if bound else {}
        finished, eos, max_len = Status.FINISHED, self.eos_token_ids, self.max_model_len
        for row, (seq, pos) in enumerate(zip(done.seqs, done.positions)):
            if seq.status is finished:  # aborted, or ended by the step before: drop the token
                continue
            token = tokens[row]
            seq.token_ids[pos] = token
            p, n_out = seq.params, pos + 1 - len(seq.prompt_token_ids)
            reason = _stop_reason(p, token, eos)
            if reason is None and seq.matcher is not None:
                if not accepted.get(row, True):
                    log.error("request %s: token %d is outside its grammar", seq.request_id, token)
                    reason = "stop"
                elif seq.matcher.is_terminated():
                    reason = "stop"  # the grammar is complete: it took a stop token (ignore_eos did not end it)
            if reason is None and (n_out >= p.max_new_tokens or pos + 1 >= max_len):
                reason = "length"
            if n_out == 1:
                out = RequestOutput(seq.request_id, token, None, None, reason, len(seq.prompt_token_ids),
                                    seq.num_cached_prompt_tokens, seq.queue_seconds)
            else:
                out = RequestOutput(seq.request_id, token, finish_reason=reason)
            if logprobs is not None:
                out.logprob = logprobs[row] if p.logprobs else None
                out.top_logprobs = tops[row] if tops is not None else None
            outputs.append(out)
            if reason is not None:
                self.abort(seq.request_id)
        if done.verified:
            outputs += self._accept_verified(done.verified)
        return outputs

    def _accept_verified(self, verified: list[tuple[Sequence, list[int]]]) -> list[RequestOutput]:
        """A speculative step's verified sequences: their accepted draft tokens and the target's next token join
        token_ids and are reported in order, up to the first that ends the request (no grammar, logprobs or
        penalties here: those sequences never speculate)."""
        outputs, eos, max_len = [], self.eos_token_ids, self.max_model_len
        for seq, tokens in verified:
            if seq.status is Status.FINISHED:  # aborted meanwhile
                continue
            p = seq.params
            for token in tokens:
                seq.token_ids.append(token)
                reason = _stop_reason(p, token, eos)
                if reason is None and (len(seq.token_ids) - seq.num_prompt_tokens >= p.max_new_tokens
                                       or len(seq.token_ids) >= max_len):
                    reason = "length"
                outputs.append(RequestOutput(seq.request_id, token, finish_reason=reason))
                if reason is not None:
                    self.abort(seq.request_id)
                    break
            else:
                self.scheduler.accept(seq, len(tokens) - 1)
        return outputs

    def _fail(self, seqs: list[Sequence], error: Exception) -> list[RequestOutput]:
        # The other tensor-parallel ranks may have run (or be waiting in) a step this rank gave up: out of step.
        self._broken |= self.workers is not None
        failed = [s for s in seqs if s.status != Status.FINISHED]
        # The details are for the operator: clients learn that their step failed, not the engine's internals.
        log.error("engine step failed for requests %s", [s.request_id for s in failed], exc_info=error)
        for seq in failed:
            self.abort(seq.request_id)
        return [RequestOutput(seq.request_id, error=STEP_FAILED) for seq in failed]

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (the engine core ends; an offline LLM is done)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def healthy(self) -> bool:
        """False once the device itself failed (a CUDA error poisons the context: only a new process recovers), or
        a step failed under tensor parallelism."""
        if self._broken:
            return False
        if self.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.device)
            return True
        except Exception:
            log.exception("the CUDA context is broken")
            return False
