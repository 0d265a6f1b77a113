"""Structured outputs: a request's grammar (a JSON schema, any JSON, or a regular expression) compiled by
xgrammar against the model's vocabulary, and the per-step token masks that keep its output inside the grammar.

Compiling takes milliseconds to seconds, so it runs on worker threads (xgrammar caches compiled grammars by
their source); the engine core admits the request once it is done. Each step, the masks of the grammar-bound rows
are filled on the CPU while the GPU runs the step's forward pass, and the sampler applies them to the logits.
"""
import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from service.protocol import Grammar

COMPILE_THREADS = 2
# xgrammar's messages start with a timestamp and a C++ source location: the client needs neither.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """The grammar cannot be compiled (the message says why, for the client)."""


def _message(error: Exception) -> str:
    text = str(error).strip()
    return _SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else type(error).__name__


class Grammars:
    """The engine's compiler of request grammars for one tokenizer and vocabulary."""

    def __init__(self, model_dir, vocab_size: int, stop_token_ids: list[int]):
        self._model_dir, self._model_vocab_size, self._stop_token_ids = model_dir, vocab_size, stop_token_ids
        self.vocab_size = vocab_size  # until the tokenizer has loaded (the first grammar's compile)
        self._compiler = self._json_tokens = None
        self._starting = threading.Lock()  # the first compiles, on two threads, start the compiler once
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def _compile(self, grammar: Grammar):
        import xgrammar as xgr  # a second of imports, paid by the first grammar, on a worker thread

        with self._starting:
            if self._compiler is None:
                self._start_compiler(xgr)
        try:
            if grammar.kind == "json":
                # Compact JSON: a model that likes whitespace could otherwise spend its whole budget on it.
                schema = grammar.value or json.dumps({"type": "object"})
                return self._compiler.compile_json_schema(schema, any_whitespace=False)
            if grammar.kind == "regex":
                return self._compiler.compile_regex(grammar.value)
        except Exception as e:  # xgrammar raises RuntimeError (and ValueError) for every bad input
            raise GrammarError(_message(e)) from None
        raise GrammarError(f"unknown grammar kind {grammar.kind!r}")

    def _start_compiler(self, xgr) -> None:
        from service.text import load_tokenizer

        tokenizer = load_tokenizer(self._model_dir)
        # Masks cover the tokenizer's tokens only: the sampler forbids the ids a padded embedding adds past them
        # (xgrammar would check each of those in every mask: 0.3 ms a row for 148k of them).
        self.vocab_size = min(len(tokenizer), self._model_vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self._stop_token_ids)
        self._json_tokens = self._without_control_bytes(info.decoded_vocab)
        self._compiler = xgr.GrammarCompiler(info)

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

    def compile(self, grammar: Grammar) -> Future:
        """A future of the compiled grammar; its exception is GrammarError for a bad one."""
        return self._pool.submit(self._compile, grammar)

    @staticmethod
    def matcher(compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    @staticmethod
    def accept(matchers: list, tokens: list[int]) -> list[bool]:
        """Advances each matcher by its row's sampled token; False where a token was refused."""
        return [matcher.accept_token(token) for matcher, token in zip(matchers, tokens)]

    def fill_masks(self, matchers: list, json_rows: list[int]) -> torch.Tensor:
        """The allowed tokens of each matcher's next step, as bits: [len(matchers), ceil(vocab / 32)] int32 in
        pinned memory (ready for a copy to the device that does not wait). A finished matcher allows everything:
        its row's token is dropped anyway. json_rows: the rows of JSON grammars."""
        masks = torch.full((len(matchers), self.words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        # One row at a time: 64 rows took 0.36 ms on the H100 host (xgrammar's BatchGrammarMatcher, with its
        # threads, has not been measured since the masks stopped covering padded ids).
        for row, matcher in enumerate(matchers):
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(masks, row)
        if len(json_rows) == len(matchers):
            masks &= self._json_tokens
        else:
            for row in json_rows:
                masks[row] &= self._json_tokens
        return masks

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

