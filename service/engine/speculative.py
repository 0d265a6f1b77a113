"""Speculative decoding: proposers guess a sequence's next tokens, the target model scores the guesses and the
token after them in one step (k + 1 query rows over the cached context, run as decode rows: see
service.engine.model_runner), and verification keeps the longest prefix the target agrees with, plus one token of
its own.

Exactness. A greedy sequence accepts a draft token while it equals the target's argmax, then takes the argmax at
the first mismatch (or after the last draft): the tokens it would have produced one step at a time. A sampled
sequence uses rejection sampling. An n-gram draft is a point mass q = 1 on its token d, so d is accepted with
probability min(1, p(d) / q) = p(d) (p: the target's distribution after logit bias, temperature, top-k/top-p and
min-p, as the sampler computes it); on rejection the token is drawn from the residual max(0, p - q), normalized:
p without d. Each output token then follows p exactly. Draws use the sequence's own generator when it has a seed
(the same drafts give the same tokens), the global one otherwise.

What falls back to plain decoding (no proposal for the sequence): penalties and grammars (they need each token
on the host before the next is scored), logprobs and top logprobs, and min_tokens until it is reached. The step
also proposes nothing when `speculative_disable_by_batch_size` sequences or more run (a large batch is bound by
compute, where scoring guesses costs more than it saves).

Acceptance back-off (`speculative_min_acceptance`): every verify moves the sequence's exponential moving average
of its accepted fraction (accepted / drafted tokens; weight EMA_WEIGHT, from 1.0) towards that verify's. Below the
threshold the sequence proposes nothing for its next BACKOFF_MIN tokens (no lookup, no verify rows), then tries one
draft again; each failed try doubles the pause, up to BACKOFF_MAX, and a verify that lifts the average back over the
threshold resets it. A request that stops copying soon stops paying for drafts, one that starts copying again gets
them back within BACKOFF_MAX tokens. It reads only the sequence's own drafts and tokens: greedy outputs stay those of
plain decoding, seeded ones reproducible.

Rollback: the scheduler reserves KV slots for the drafts (BlockManager.append's lookahead) without making them
part of the sequence; after verification `Scheduler.accept` counts the accepted tokens as computed and gives back
the blocks that only rejected tokens reached. A rejected token's slot is overwritten by the next step, and the
prefix cache registers only blocks wholly before a sequence's last accepted token, so it never holds a rejected
token's K/V.

A proposer that raises (the draft model out of memory, a bug) costs its step nothing but the drafts: the step runs
without them, the proposer's per-sequence state is dropped (`reset`, when it keeps any) and rebuilt from the
sequences' tokens at the next proposal; after MAX_PROPOSER_FAILURES failing proposals in a row speculation stays
off for the engine's life, with an error in the log. Greedy outputs are unchanged either way.

Proposers implement `Proposer`; `make_proposer` picks one from the settings. The draft model
(service.engine.draft_model, `speculative_model`) is a smaller model with the target's vocabulary: it catches up on
each sequence's new tokens (rolling back the drafts the target rejected) and decodes greedily, with a paged KV cache,
a ModelRunner and CUDA graphs of its own; its greedy drafts are point masses, verified as n-gram ones are. A proposer
that keeps state for a sequence (the draft model's KV blocks) also has `release(seq)`, which the engine calls when
the sequence finishes or is aborted. EAGLE-style heads, which draft from the target's hidden states, would implement
`Proposer` too.
"""
import logging
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from service.config import Settings
from service.engine.draft_model import load_proposer
from service.engine.sampler import on_device, target_probs
from service.engine.sequence import Sequence, Status
from service.model.config import ModelConfig
from service.protocol import SamplingParams

# The acceptance back-off (module doc): weight of the latest verify in the average, and the pause in the sequence's
# own tokens, first and longest. Nine wholly rejected drafts in a row take a fresh sequence below 0.15 (the default
# speculative_min_acceptance). Chosen with spec.py's backoff_policy section (one stream, k = 4, step costs measured
# on the H100): against the constants before (weight 0.5, threshold 0.1, pauses up to 128), which backed off from
# drafts that paid (acceptance 0.5: 1.68x where drafting regardless gives 1.82x), these keep them (1.81x), cost the
# same where nothing is accepted (0.98x), and do as well or better where a request starts or stops copying.
EMA_WEIGHT = 0.2
BACKOFF_MIN, BACKOFF_MAX = 8, 64
MAX_PROPOSER_FAILURES = 3

log = logging.getLogger(__name__)


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] draft tokens to follow seqs[i]'s tokens (all known on the host), per sequence. Optional:
        release(seq), for proposers that keep state for a sequence (see the module's doc)."""


class NgramProposer:
    """Prompt lookup: finds the latest earlier occurrence of the sequence's last n tokens (n from `max_n` down to
    `min_n`, the longest match first) in its prompt and output, and proposes the tokens that followed it. Each
    sequence keeps an NgramIndex of its tokens, grown by the tokens each step adds: a lookup costs a few
    dictionary reads, not a scan of the context (which took 0.1-0.8 ms a sequence at 500-8,000 tokens)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[Sequence, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, limits):
            index = self.indexes.get(seq)
            if index is None:
                index = self.indexes[seq] = NgramIndex(self.min_n, self.max_n)
            index.update(seq.token_ids)
            drafts.append(index.lookup(seq.token_ids, k))
        return drafts

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The draft for a token list seen once (no index kept)."""
        index = NgramIndex(self.min_n, self.max_n)
        index.update(tokens)
        return index.lookup(tokens, k)

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq, None)

    def reset(self) -> None:
        self.indexes.clear()


class NgramIndex:
    """Where each n-gram of a token list (n from min_n to max_n) last ended, over its tokens but the last (a match
    must be followed by a token to propose). update() indexes the tokens added since the last call: a sequence's
    tokens only grow."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def update(self, tokens: list[int]) -> None:
        stop = len(tokens) - 1
        for end in range(self.indexed, stop):  # later ends overwrite earlier ones
            for n, ends in self.ends.items():
                if end >= n - 1:
                    ends[tuple(tokens[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, stop)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of the longest suffix of tokens (indexed up to its
        last) that occurred before."""
        length = len(tokens)
        if k < 1 or length <= self.min_n:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.ends[n].get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []


def make_proposer(s: Settings, device: torch.device, dtype: torch.dtype, max_model_len: int,
                  target: ModelConfig) -> Proposer:
    """The proposer of s.speculative_method for a target model of config `target` (a draft model loads onto the
    target's device, in its dtype: call this before the target sizes its KV cache)."""
    if s.speculative_method == "ngram":
        return NgramProposer(s.prompt_lookup_min, s.prompt_lookup_max)
    if s.speculative_method == "draft_model":
        return load_proposer(s, device, dtype, max_model_len, target)
    raise ValueError(f"unknown speculative method {s.speculative_method!r}")


def can_speculate(seq: Sequence) -> bool:
    """Whether verification can reproduce the sampler's distribution for this sequence (see the module's doc)."""
    p: SamplingParams = seq.params
    return (not p.needs_history and not p.logprobs and not p.top_logprobs
            and len(seq.token_ids) - seq.num_prompt_tokens >= p.min_tokens)


@dataclass
class SpecStats:
    """Running totals, as vLLM counts them: drafts (sequences verified with at least one draft token), draft
    tokens, accepted draft tokens, and accepted ones by their place in the draft."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    backoffs: int = 0  # ours: pauses of a sequence's proposals for low acceptance
    proposer_failures: int = 0  # ours: proposals that raised (their steps ran without drafts)


class _Acceptance:
    """A sequence's back-off state: its average accepted fraction, its next pause, and the length (of token_ids)
    from which it proposes again."""
    __slots__ = ("ema", "backoff", "resume_at")

    def __init__(self):
        self.ema, self.backoff, self.resume_at = 1.0, BACKOFF_MIN, 0


class Speculator:
    """The engine's side of speculation: proposals before a step is scheduled, verification after it ran."""

    def __init__(self, proposer: Proposer, num_tokens: int, disable_by_batch_size: int | None, max_model_len: int,
                 min_acceptance: float):
        self.proposer, self.k = proposer, num_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.max_model_len = max_model_len
        self.min_acceptance = min_acceptance  # 0: no back-off
        self.acceptance: dict[Sequence, _Acceptance] = {}  # sequences verified while the back-off is on
        self.stats = SpecStats(accepted_per_position=[0] * num_tokens)
        self.failures_in_a_row = 0

    def active(self, running: list[Sequence]) -> bool:
        """Whether the next step proposes: not with `speculative_disable_by_batch_size` sequences running or more,
        nor after the proposer failed for good. The engine overlaps the steps that do not (a proposal reads every
        sequence's last token on the host)."""
        return self.failures_in_a_row < MAX_PROPOSER_FAILURES and (
            self.disable_by_batch_size is None or len(running) < self.disable_by_batch_size)

    def drafting(self, running: list[Sequence]) -> bool:
        """Whether the next step may propose: `active`, and some sequence can speculate and is not backing off.
        Asked before the step in flight completes (a sequence's length counts its pending token), so that the
        engine overlaps the steps that will not: a back-off's pause, or only requests with penalties, grammars or
        logprobs, must cost what plain decoding costs."""
        return self.active(running) and any(can_speculate(seq) and not self._pausing(seq) for seq in running)

    def _pausing(self, seq: Sequence) -> bool:
        """Whether seq backs off at its length (its pending token counted)."""
        state = self.acceptance.get(seq)
        return state is not None and len(seq.token_ids) < state.resume_at

    def propose(self, running: list[Sequence]) -> None:
        """Sets seq.draft for every running sequence: draft tokens for those that decode next step and are not
        backing off, else none (none at all when not `active`). A draft leaves room for the token the target adds
        after it, within max_new_tokens and the context. Every sequence's last token must be on the host when
        `drafting` (the sequences it proposes for are those that make it true)."""
        for seq in running:
            seq.draft = []
        if len(self.acceptance) > len(running):  # forget finished sequences (preempted ones keep their history)
            self.acceptance = {s: a for s, a in self.acceptance.items() if s.status is not Status.FINISHED}
        if not self.active(running):
            return
        eligible, limits = [], []
        for seq in running:
            length = len(seq.token_ids)
            if (seq.num_computed_tokens == length - 1 and length > seq.num_prompt_tokens and can_speculate(seq)
                    and not self._pausing(seq)):
                room = min(seq.token_limit, self.max_model_len) - length - 1
                if room > 0:
                    eligible.append(seq)
                    limits.append(min(self.k, room))
        if not eligible:
            return
        try:
            drafts = self.proposer.propose(eligible, limits)
        except Exception:
            self._proposer_failed()
            return
        self.failures_in_a_row = 0
        for seq, draft in zip(eligible, drafts):
            seq.draft = draft

    def _proposer_failed(self) -> None:
        self.stats.proposer_failures += 1
        self.failures_in_a_row += 1
        off = self.failures_in_a_row >= MAX_PROPOSER_FAILURES
        log.error("speculative proposal failed: the step runs without drafts%s",
                  f"; {MAX_PROPOSER_FAILURES} in a row, speculation is off from now on" if off else "",
                  exc_info=self.failures_in_a_row == 1 or off)
        reset = getattr(self.proposer, "reset", None)
        if reset is not None:
            try:
                reset()
            except Exception:  # the proposer is beyond use: speculate no more
                log.exception("the proposer could not reset; speculation is off from now on")
                self.failures_in_a_row = MAX_PROPOSER_FAILURES

    def release(self, seq: Sequence) -> None:
        """seq finished or was aborted: the proposer's state for it goes (stateless proposers have no release)."""
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(seq)

    def verify(self, logits: torch.Tensor, index: list[int], drafts: dict[int, list[int]], seqs: list[Sequence],
               argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int], list[tuple[Sequence, list[int]]]]:
        """Splits a step's logits (rows in `index` order, a verified sequence's len(draft) + 1 rows in a row) into
        the plain rows, for the sampler, and the verified sequences' tokens: (plain logits, their batch indices,
        [(sequence, its new tokens: the accepted drafts and the target's next one)]). argmax: each row's argmax
        where the step computed it (a decode graph)."""
        plain = [row for row, i in enumerate(index) if i not in drafts]
        order = list(dict.fromkeys(i for i in index if i in drafts))  # verified batch indices, in row order
        rows = [row for row, i in enumerate(index) if i in drafts]
        params = [seqs[i].params for i in order]
        draft_lists = [drafts[i] for i in order]
        tokens = verify_rows(logits, rows, draft_lists, params, [seqs[i].generator for i in order], argmax)
        for i, draft, out in zip(order, draft_lists, tokens):
            self.record(seqs[i], len(draft), len(out) - 1)
        if len(plain) == len(index):
            kept = logits
        else:
            kept = logits[_index(plain, logits.device)] if plain else logits[:0]
        return kept, [index[row] for row in plain], [(seqs[i], t) for i, t in zip(order, tokens)]

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verify of seq's draft of `drafted` tokens kept `accepted` of them (the step adds one more, the
        target's): the counters, and the back-off."""
        s = self.stats
        s.drafts += 1
        s.draft_tokens += drafted
        s.accepted_tokens += accepted
        for position in range(accepted):
            s.accepted_per_position[position] += 1
        if self.min_acceptance > 0:
            self._back_off(seq, accepted / drafted, accepted + 1)

    def _back_off(self, seq: Sequence, fraction: float, num_new: int) -> None:
        """Folds a verify's accepted fraction into seq's average; below the threshold, seq proposes nothing for
        its next `backoff` tokens (after the num_new this step adds), and the pause after that is twice as long."""
        a = self.acceptance.get(seq)
        if a is None:
            a = self.acceptance[seq] = _Acceptance()
        a.ema += EMA_WEIGHT * (fraction - a.ema)
        if a.ema >= self.min_acceptance:
            a.backoff = BACKOFF_MIN
            return
        a.resume_at = len(seq.token_ids) + num_new + a.backoff
        a.backoff = min(2 * a.backoff, BACKOFF_MAX)
        self.stats.backoffs += 1


def verify_rows(logits: torch.Tensor, rows: list[int], drafts: list[list[int]], params: list[SamplingParams],
                generators: list[torch.Generator | None], argmax: torch.Tensor | None = None) -> list[list[int]]:
    """Each sequence's new tokens from its len(draft) + 1 consecutive rows among `rows` of logits: greedy ones by
    exact match with each row's argmax (`argmax`'s, where the step computed it: the tokens plain decoding's graph
    picks, and no kernel or copy after the step but the tokens' own), sampled ones by rejection sampling
    (accept_sampled)."""
    starts = np.cumsum([0] + [len(d) + 1 for d in drafts])[:-1].tolist()
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    out: list[list[int]] = [[] for _ in drafts]
    if greedy:
        greedy_rows = [rows[r] for i in greedy for r in range(starts[i], starts[i] + len(drafts[i]) + 1)]
        row_params = [params[i] for i in greedy for _ in range(len(drafts[i]) + 1)]
        if argmax is not None and not any(p.logit_bias for p in row_params):
            every = argmax.tolist()
            targets = [every[r] for r in greedy_rows]
        else:
            targets = _biased(logits[_index(greedy_rows, logits.device)], row_params).argmax(-1).tolist()
        at = 0
        for i in greedy:
            out[i] = accept_greedy(drafts[i], targets[at:at + len(drafts[i]) + 1])
            at += len(drafts[i]) + 1
    if sampled:
        sampled_rows = [rows[r] for i in sampled for r in range(starts[i], starts[i] + len(drafts[i]) + 1)]
        row_params = [params[i] for i in sampled for _ in range(len(drafts[i]) + 1)]
        probs = target_probs(logits[_index(sampled_rows, logits.device)], row_params)
        for i, tokens in zip(sampled, accept_sampled(probs, [drafts[i] for i in sampled],
                                                     [generators[i] for i in sampled])):
            out[i] = tokens
    return out


def _index(values, device) -> torch.Tensor:
    return on_device(values, device, torch.long)


def _biased(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The logits a greedy row takes its argmax of: with its logit bias (the sampler's order: bias, then argmax)."""
    if not any(p.logit_bias for p in params):
        return logits
    logits = logits.float()
    for row, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            logits[row, token] += bias
    return logits


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The drafts up to the first that differs from the target's argmax at its place, then the target's token
    there (or after the last draft)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return draft[:accepted] + [targets[accepted]]


def accept_sampled(probs: torch.Tensor, drafts: list[list[int]], generators: list[torch.Generator | None]
                   ) -> list[list[int]]:
    """Rejection sampling of point-mass drafts. probs: [sum(len(d) + 1), vocab], the target's distribution at each
    sequence's rows. Draft token j of a sequence is accepted with probability p_j(d_j), while all before it were;
    the first rejected place takes a token from p_j without d_j (renormalized), and a sequence whose drafts were
    all accepted takes one from its last row's p."""
    device = probs.device
    lengths = [len(d) for d in drafts]
    starts = np.cumsum([0] + [n + 1 for n in lengths])[:-1]
    draft_rows = _index([s + j for s, n in zip(starts, lengths) for j in range(n)], device)
    draft_ids = _index([t for d in drafts for t in d], device)
    p_draft = probs[draft_rows, draft_ids]
    uniforms = torch.rand(len(draft_ids), device=device)
    at = 0
    for n, g in zip(lengths, generators):  # seeded sequences draw from their own generator
        if g is not None:
            uniforms[at:at + n] = torch.rand(n, device=device, generator=g)
        at += n
    accepted = (uniforms < p_draft).tolist()
    counts, at = [], 0
    for n in lengths:
        a = 0
        while a < n and accepted[at + a]:
            a += 1
        counts.append(a)
        at += n
    final = probs[_index([int(s) + a for s, a in zip(starts, counts)], device)].clone()
    rejected = [(i, drafts[i][a]) for i, (a, n) in enumerate(zip(counts, lengths)) if a < n]
    if rejected:
        rows, ids = zip(*rejected)
        final[_index(rows, device), _index(ids, device)] = 0.0
    # Exponential race (argmax of p / E, E ~ Exp(1)) draws from p unnormalized: the residual needs no division.
    noise = torch.empty_like(final).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    tokens = (final / noise).argmax(-1).tolist()
    return [d[:a] + [t] for d, a, t in zip(drafts, counts, tokens)]
