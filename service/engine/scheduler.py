"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step spends a token budget: running sequences first (oldest first: one token per decode, the next
chunk of an unfinished prefill), then waiting sequences are admitted while blocks and budget last. When a
running sequence needs a block and none is free, the newest running sequences are preempted: their blocks
are freed and they go back to the front of the queue, to be recomputed later (prefix caching usually finds
their blocks again).
"""
import time
from collections import deque
from dataclasses import dataclass, field

from service.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens of each sequence in this step
    is_prefill: list[bool] = field(default_factory=list)  # prompt (or recomputation) chunk, not a decode
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies to do first
    num_preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.is_prefill.append(n > 1 or seq.num_computed_tokens < seq.num_prompt_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, prefill in zip(self.num_tokens, self.is_prefill) if prefill)


class Scheduler:
    def __init__(self, block_manager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admission first

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def free(self, seq: Sequence) -> None:
        """Drops a sequence wherever it is (finished, aborted or failed) and frees its blocks."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq.request_id)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.request_id)
        seq.status, seq.num_computed_tokens = Status.WAITING, 0
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        queried, hits = bm.prefix_queried_tokens, bm.prefix_hit_tokens
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch()
        for seq in list(self.running):
            if budget == 0 or len(batch.seqs) == self.max_num_seqs:
                break
            if seq.status != Status.RUNNING:  # preempted below while making room for an older one
                continue
            # A decode's new token (sampled last step) needs its slot: grow the table, preempting if needed.
            missing = len(seq.token_ids) - bm.num_tokens[seq.request_id]
            while missing and not bm.can_append(seq.request_id, missing):
                victim = self.running[-1]
                self._preempt(victim)
                batch.num_preemptions += 1
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                continue
            if missing:
                batch.copies += bm.append(seq.request_id, seq.cache_keys)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, n)
            budget -= n
        while (self.waiting and budget > 0 and len(batch.seqs) < self.max_num_seqs
               and len(self.running) < self.max_num_seqs and not batch.num_preemptions):
            seq = self.waiting[0]
            if not bm.can_allocate(seq.cache_keys):
                break
            self.waiting.popleft()
            cached = bm.allocate(seq.request_id, seq.cache_keys)
            if seq.queue_seconds is None:  # first admission (a preempted sequence comes back here later)
                seq.num_cached_prompt_tokens = cached
                seq.queue_seconds = time.perf_counter() - seq.arrival
            seq.num_computed_tokens, seq.status = cached, Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, n)
            budget -= n
        batch.prefix_queried_tokens = bm.prefix_queried_tokens - queried
        batch.prefix_hit_tokens = bm.prefix_hit_tokens - hits
        return batch
