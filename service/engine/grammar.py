"""Structured outputs: a request's grammar (a JSON schema, any JSON, or a regular expression) compiled by
xgrammar against the model's vocabulary, and the per-step token masks that keep its output inside the grammar.

Compiling takes milliseconds for most grammars and seconds to minutes for some (long enums, many bounded strings),
so it runs on worker threads, fed by the engine core's CompileQueue: at most COMPILE_THREADS compiles run at once,
requests that wait on the same grammar share its compile, a request whose client left leaves the queue, and a
grammar that takes longer than `grammar_compile_timeout` is refused (and refused at once from then on). xgrammar
cannot interrupt a compile: one nobody waits for any more finishes in its thread, on one of SPARE_THREADS.

Memory: compiled grammars stay in xgrammar's cache, least recently used dropped past `grammar_cache_bytes`; the
grammars of running requests are counted apart (Grammars.hold), and a request whose grammar would take them past
`grammar_cache_bytes` waits until others finish. Each step, the masks of the grammar-bound rows are filled on the
CPU while the GPU runs the step's forward pass, and the sampler applies them to the logits.
"""
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from service.protocol import Grammar

log = logging.getLogger(__name__)
COMPILE_THREADS = 2
SPARE_THREADS = 2  # for compiles nobody waits for any more (timed out, or their clients left): xgrammar runs them out
# Threads that fill one step's masks, a share of the rows each (xgrammar lets go of the GIL while it fills): a row
# can cost a millisecond where few of a vocabulary's tokens are decided when the grammar compiles (1.1 ms for
# benchmarks/serve.py's word-level 151,936-token vocabulary under a regex of its words, on the development machine's
# CPU), and the step waits on the sum. Half the cores, at most 8: several engine cores share a host under data
# parallelism. The rows are shared out only where the last step's masks, filled one after another, would take
# SPREAD_MS or more: inside the engine, with the GPU's step in flight, handing rows out costs about a millisecond (on
# the H200 machine's host, 64 rows of JSON masks on the embedded model's vocabulary, 0.3-0.4 ms one after another,
# took 1.25 ms on 8 threads, 0.75 on 2, 0.65-0.74 with xgrammar's BatchGrammarMatcher), where apart from the engine
# the same rows take 0.15 ms on 8 threads (benchmarks/structured.py --sections masks).
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # ours to use
FILL_THREADS = max(1, min(8, _CPUS // 2))
SPREAD_MS = 1.5
TOO_SLOW_REMEMBERED = 1024  # grammars that timed out, refused at once when asked for again
# xgrammar's messages start with a timestamp and a C++ source location: the client needs neither.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """The grammar cannot be compiled, or can never be matched (the message says why, for the client)."""


def _message(error: Exception) -> str:
    text = str(error).strip()
    return _SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else type(error).__name__


class Grammars:
    """The engine's compiler of request grammars for one tokenizer and vocabulary."""

    def __init__(self, model_dir, vocab_size: int, stop_token_ids: list[int], cache_bytes: int = 128 << 20,
                 fill_threads: int = FILL_THREADS, pin_memory: bool = False):
        self._model_dir, self._model_vocab_size, self._stop_token_ids = model_dir, vocab_size, stop_token_ids
        self._pin_memory = pin_memory  # masks for a CUDA engine (a CPU one on a GPU host would make a CUDA context)
        self._fill_threads = fill_threads
        self.vocab_size = vocab_size  # until the tokenizer has loaded (the first grammar's compile)
        self.cache_bytes = cache_bytes
        self._compiler = self._json_tokens = None
        self.ready_at: float | None = None  # time.monotonic() when the compiler had started (the first compile)
        self._fill_pool = ThreadPoolExecutor(fill_threads, thread_name_prefix="grammar-masks")
        self._row_ms = 0.0  # a mask's CPU milliseconds at the last step
        self._starting = threading.Lock()  # the first compiles, on two threads, start the compiler once
        self._pool = ThreadPoolExecutor(COMPILE_THREADS + SPARE_THREADS, thread_name_prefix="grammar")
        self._live: dict[int, list] = {}  # id of a compiled grammar running requests hold -> [it, bytes, holders]
        self.live_bytes = 0

    def _compile(self, grammar: Grammar):
        import xgrammar as xgr  # a second of imports, paid by the first grammar, on a worker thread

        with self._starting:
            if self._compiler is None:
                self._start_compiler(xgr)
        try:
            if grammar.kind == "json":
                # Compact JSON: a model that likes whitespace could otherwise spend its whole budget on it.
                schema = grammar.value or json.dumps({"type": "object"})
                compiled = self._compiler.compile_json_schema(schema, any_whitespace=False)
            elif grammar.kind == "regex":
                compiled = self._compiler.compile_regex(grammar.value)
            else:
                raise GrammarError(f"unknown grammar kind {grammar.kind!r}")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError (and ValueError) for every bad input
            raise GrammarError(_message(e)) from None
        masks = torch.full((1, self.words), -1, dtype=torch.int32)
        matcher = xgr.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(masks, 0)
        if grammar.kind == "json":
            masks &= self._json_tokens
        # Its requests could only fail (or, for JSON, end empty, which is no JSON value): refuse them up front.
        if not self.allows_any(masks[0], self._stop_token_ids if grammar.kind == "json" else ()):
            raise GrammarError("the grammar matches no output at all (an empty anyOf, say, or an empty character "
                               "class)")
        return compiled

    def _start_compiler(self, xgr) -> None:
        from service.text import load_tokenizer

        tokenizer = load_tokenizer(self._model_dir)
        # Masks cover the tokenizer's tokens only: the sampler forbids the ids a padded embedding adds past them
        # (xgrammar would check each of those in every mask: 0.3 ms a row for 148k of them).
        self.vocab_size = min(len(tokenizer), self._model_vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self._stop_token_ids)
        self._json_tokens = self._without_control_bytes(info.decoded_vocab)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self.cache_bytes)
        self.ready_at = time.monotonic()

    def _without_control_bytes(self, decoded_vocab: list[bytes]) -> torch.Tensor:
        """Bits of the tokens with no control character. JSON strings must escape those, but xgrammar's strings
        with a maxLength let them through (0.2.8); compact JSON never needs one outside a string either."""
        allowed = torch.zeros(self.words * 32, dtype=torch.bool)
        allowed[:len(decoded_vocab)] = torch.tensor([not any(b < 0x20 for b in t) for t in decoded_vocab])
        bits = allowed.view(self.words, 32).to(torch.int64) << torch.arange(32)
        return bits.sum(1).to(torch.int32)  # int32 wraps bit 31 to the sign, as xgrammar's masks have it

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def compile(self, grammar: Grammar, on_done: Callable[[Future], None] | None = None) -> Future:
        """A future of the compiled grammar; its exception is GrammarError for a bad one. on_done: called (on the
        compiling thread) once it is done."""
        future = self._pool.submit(self._compile, grammar)
        if on_done is not None:
            future.add_done_callback(on_done)
        return future

    # -- the grammars of running requests ------------------------------------------------------------------
    def holds(self, compiled) -> bool:
        return id(compiled) in self._live

    def fits(self, compiled, pending: int = 0) -> bool:
        """Whether running requests may take on this grammar beside `pending` bytes about to be held: within
        cache_bytes, or it is held already, or nothing is (a grammar alone always runs)."""
        if self.holds(compiled) or not (self._live or pending):
            return True
        return self.live_bytes + pending + compiled.memory_size_bytes <= self.cache_bytes

    def hold(self, compiled) -> None:
        """A sequence runs with this grammar until release()."""
        entry = self._live.get(id(compiled))
        if entry is None:
            entry = self._live[id(compiled)] = [compiled, compiled.memory_size_bytes, 0]
            self.live_bytes += entry[1]
        entry[2] += 1

    def release(self, compiled) -> None:
        entry = self._live[id(compiled)]
        entry[2] -= 1
        if entry[2] == 0:
            del self._live[id(compiled)]
            self.live_bytes -= entry[1]

    # -- steps ---------------------------------------------------------------------------------------------
    @staticmethod
    def matcher(compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    @staticmethod
    def accept(matchers: list, tokens: list[int]) -> list[bool]:
        """Advances each matcher by its row's sampled token; False where a token was refused."""
        return [matcher.accept_token(token) for matcher, token in zip(matchers, tokens)]

    def fill_masks(self, matchers: list, json_rows: list[int]) -> torch.Tensor:
        """The allowed tokens of each matcher's next step, as bits: [len(matchers), ceil(vocab / 32)] int32, in
        pinned memory for a CUDA engine (ready for a copy to the device that does not wait). A finished matcher
        allows everything: its row's token is dropped anyway. json_rows: the rows of JSON grammars."""
        masks = torch.full((len(matchers), self.words), -1, dtype=torch.int32, pin_memory=self._pin_memory)
        live = [row for row, matcher in enumerate(matchers) if not matcher.is_terminated()]

        def fill(rows: list[int]) -> float:
            """Fills rows; their CPU seconds. The rows' own work, not the wall time, decides the next step: the
            wall time of shared rows holds the handing out, and judging by it kept cheap masks on threads."""
            start = time.thread_time()
            for row in rows:
                matchers[row].fill_next_token_bitmask(masks, row)
            return time.thread_time() - start

        threads = min(self._fill_threads, len(live)) if len(live) * self._row_ms >= SPREAD_MS else 1
        if threads > 1:
            seconds = sum(self._fill_pool.map(fill, [live[i::threads] for i in range(threads)]))
        else:
            seconds = fill(live)
        if live:
            self._row_ms = seconds * 1e3 / len(live)
        if len(json_rows) == len(matchers):
            masks &= self._json_tokens
        else:
            for row in json_rows:
                masks[row] &= self._json_tokens
        return masks

    @staticmethod
    def allows_any(mask: torch.Tensor, excluding: list[int] = ()) -> bool:
        """Whether a row of masks allows some token other than those `excluding`."""
        if excluding:
            mask = mask.clone()
            for token in excluding:
                word, bit = divmod(token, 32)
                if word < len(mask):
                    mask[word] &= 0x7FFFFFFF if bit == 31 else ~(1 << bit)  # int32: bit 31 is the sign
        return bool(mask.any())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False)


@dataclass
class _Compile:
    """One grammar queued, compiling, or compiled and waiting for room among the running grammars, with the
    requests that wait on it (request id -> the caller's item)."""
    grammar: Grammar
    waiting: dict[str, object] = field(default_factory=dict)
    future: Future | None = None
    deadline: float = 0.0
    compiled: object = None


class CompileQueue:
    """The engine core's requests whose grammar is not ready yet. The core adds them, removes those whose clients
    left, and polls for those it may admit (and those refused); `wake` is called from a compiling thread when a
    compile ends, so that the core's loop polls without polling on a timer."""

    def __init__(self, grammars: Grammars, timeout: float, wake: Callable[[], None]):
        self.grammars, self.timeout, self._wake = grammars, timeout, wake
        self._queue: dict[tuple[str, str], _Compile] = {}  # first asked, first compiled
        self._abandoned: set[Future] = set()  # still running in their threads, nobody waiting for them
        self._too_slow: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.requests = 0  # requests waiting in the queue

    def __len__(self) -> int:
        return self.requests

    def add(self, grammar: Grammar, request_id: str, item) -> None:
        """Queues a request for its grammar; GrammarError at once for one that timed out before."""
        key = (grammar.kind, grammar.value)
        if key in self._too_slow:
            self._too_slow.move_to_end(key)
            raise GrammarError(self._too_slow_message())
        self._queue.setdefault(key, _Compile(grammar)).waiting[request_id] = item
        self.requests += 1

    def remove(self, request_id: str) -> bool:
        """Drops a request (its client left); a grammar nobody waits for any more is not compiled, or left to
        finish in its thread. False when the request is not here."""
        for key, entry in self._queue.items():
            if entry.waiting.pop(request_id, None) is not None:
                self.requests -= 1
                if not entry.waiting:
                    self._drop(key)
                return True
        return False

    def _drop(self, key) -> None:
        entry = self._queue.pop(key)
        if entry.future is not None:
            self._abandon(entry.future)

    def _abandon(self, future: Future) -> None:
        """A compile nobody waits for: xgrammar cannot stop it, so it holds a spare thread until it ends."""
        if not future.done():
            self._abandoned.add(future)
            future.add_done_callback(self._abandoned.discard)

    def _too_slow_message(self) -> str:
        return (f"the grammar is too complex: it did not compile within {self.timeout:g} s "
                "(grammar_compile_timeout); simplify it (fewer or shorter bounded strings, smaller enums)")

    def poll(self) -> tuple[list[tuple[object, object]], list[tuple[object, str]]]:
        """(ready, refused): the requests whose grammar compiled and fits among the running ones, with it, and
        those refused, with the reason. Starts queued compiles on the threads that are free."""
        now = time.monotonic()
        ready, refused, running, pending = [], [], 0, 0
        for key, entry in list(self._queue.items()):
            if entry.future is not None:
                if not entry.future.done() and now < self._deadline(entry):
                    running += 1
                    continue
                reason = self._outcome(key, entry)
                if reason is not None:
                    refused += [(item, reason) for item in entry.waiting.values()]
                    self._finish(key)
                    continue
            if entry.compiled is None or not self.grammars.fits(entry.compiled, pending):
                continue  # queued, or waiting for room among the running grammars
            if not self.grammars.holds(entry.compiled):
                pending += entry.compiled.memory_size_bytes
            ready += [(item, entry.compiled) for item in entry.waiting.values()]
            self._finish(key)
        for entry in self._queue.values():
            if running >= COMPILE_THREADS or running + len(self._abandoned) >= COMPILE_THREADS + SPARE_THREADS:
                break
            if entry.future is None and entry.compiled is None:
                entry.future = self.grammars.compile(entry.grammar, lambda _: self._wake())
                entry.deadline = now + self.timeout
                running += 1
        return ready, refused

    def _deadline(self, entry: _Compile) -> float:
        """When a running compile times out: its timeout counts from the compiler's start for the first grammars,
        which wait on it (xgrammar's import and the vocabulary's reading: half a second for a 151,936-token one on
        the development machine, more on a slower host), time that says nothing of theirs. Never while it
        starts."""
        ready_at = self.grammars.ready_at
        return math.inf if ready_at is None else max(entry.deadline, ready_at + self.timeout)

    def _outcome(self, key, entry: _Compile) -> str | None:
        """Takes a compile that ended or ran out of time: None once entry.compiled holds the grammar, else why its
        requests are refused."""
        future, entry.future = entry.future, None
        if not future.done():
            log.warning("a grammar did not compile within %g s: refused from now on", self.timeout)
            self._abandon(future)
            self._too_slow[key] = None
            if len(self._too_slow) > TOO_SLOW_REMEMBERED:
                self._too_slow.popitem(last=False)
            return self._too_slow_message()
        try:
            entry.compiled = future.result()
        except GrammarError as e:
            return str(e)
        except Exception:
            log.exception("compiling a grammar failed")
            return "the grammar could not be compiled"
        return None

    def _finish(self, key) -> None:
        """Takes a grammar out of the queue with every request waiting on it."""
        self.requests -= len(self._queue[key].waiting)
        self._drop(key)

    def seconds_to_deadline(self) -> float | None:
        """Until the first running compile times out (while the compiler starts, a timeout from now: its deadline
        is known then); None when none runs."""
        now = time.monotonic()
        deadlines = [min(self._deadline(e), now + self.timeout) for e in self._queue.values()
                     if e.future is not None and not e.future.done()]
        return max(0.0, min(deadlines) - now) if deadlines else None
