"""Continuous batching: which sequences run in the next step, and how many of their tokens. The scheduler is the
one owner of KV-cache bookkeeping (block tables, prefix cache, copy-on-write), through its BlockManager.

Every step spends a token budget: running sequences first (oldest first: one token per decode, the next
chunk of an unfinished prefill), then waiting sequences are admitted while blocks and budget last. A step that
carries prompts beside decodes costs about 1.5x a decode step, whatever the prompts' count: while sequences
decode, new requests are held back (at most `hold_steps` steps, and not once enough prompt tokens wait to fill
the step) so that they are admitted together, as TGI does. When a
running sequence needs a block and none is free, the newest running sequences are preempted: their blocks
are freed and they go back to the front of the queue, to be recomputed later (prefix caching usually finds
their blocks again).

LoRA adapters: at most max_loras distinct adapters run at once (the runner's slots); an adapter that must wait
for a slot holds back later requests for other adapters until it gets one (_AdapterSlots), never the base model's.

Fairness: when the sequences that want to run outnumber a step's places (max_num_seqs), each group (one HTTP
request with all its prompts and completions, or every request of one OpenAI `user`) is entitled to an equal share
of them. Groups under their share that wait are admitted first, taking places from the newest sequences of groups
over their share (preempted), and a request's completions beyond its share run later on their own (from the
prefix cache). Nobody waits for a request of hundreds of sequences to finish. A request's completions hold their
places from its admission on, while they wait for its prompt to fork (Scheduler.forking), so that no step ever runs
or samples more than max_num_seqs sequences; beyond their group's share they are the first to give places up.

Priority (policy "priority"; "fcfs" serves every request at priority 0): a lower `priority` value is served first.
The waiting queue is kept in (priority, arrival) order and the running list in (priority, admission) order, so a
sequence is admitted before any of a lower priority, scheduled before them, and preempted after them when blocks run
out (the lowest-priority, newest first). Fairness works within a priority level: a level's groups under their share
are admitted before its other sequences, and take places only from over-share sequences of their priority or lower.

With overlapped scheduling, step N+1 is scheduled while step N runs: a sequence sampled in step N already holds
that token (still PENDING on the GPU), so it decodes again in N+1, unless that token is its last (length limit).
Freeing blocks while a step that uses them is in flight is safe: any later use is by a later step, which the GPU
runs after it.

Speculative decoding: a decoding sequence with draft tokens (Sequence.draft) is scheduled as its last token and
the draft after it (ScheduledBatch.drafts), in KV slots reserved past the sequence while free blocks and the budget
last; `accept` then counts the verified tokens as computed and gives back the blocks only rejected ones reached.
"""
import bisect
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from kvcache import BlockManager
from service.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # position of each sequence's first new token
    num_tokens: list[int] = field(default_factory=list)  # new tokens of each sequence in this step
    is_prefill: list[bool] = field(default_factory=list)  # prompt (or recomputation) chunk, not a decode
    block_tables: list[list[int]] = field(default_factory=list)  # each sequence's blocks (read-only for the runner)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies to do first
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (child, parent): child samples from the
    # logits of its parent's last prompt token in this step
    drafts: dict[int, list[int]] = field(default_factory=dict)  # index in seqs -> the draft tokens its step scores
    # after its last token (speculative decoding: they are not the sequence's until verified)
    num_preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    def add(self, seq: Sequence, n: int, table: list[int]) -> None:
        """Schedules tokens [num_computed_tokens, + n) of seq: from here on their KV counts as computed."""
        self.seqs.append(seq)
        self.starts.append(seq.num_computed_tokens)
        self.num_tokens.append(n)
        self.is_prefill.append(n > 1 or seq.num_computed_tokens < seq.num_prompt_tokens)
        self.block_tables.append(table)
        seq.num_computed_tokens += n

    def add_verify(self, seq: Sequence, draft: list[int], table: list[int]) -> None:
        """Schedules seq's last token and its draft tokens after it: only the last token counts as computed until
        verification accepts drafts (Scheduler.accept)."""
        self.drafts[len(self.seqs)] = draft
        self.seqs.append(seq)
        self.starts.append(seq.num_computed_tokens)
        self.num_tokens.append(1 + len(draft))
        self.is_prefill.append(False)
        self.block_tables.append(table)
        seq.num_computed_tokens += 1

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, prefill in zip(self.num_tokens, self.is_prefill) if prefill)


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, max_mixed_tokens: int | None = None,
                 hold_steps: int = 0, max_loras: int = 0, policy: str = "fcfs"):
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.by_priority = policy == "priority"
        self.max_loras = max_loras  # distinct LoRA adapters among the running sequences (0: any number)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Most tokens of a step that carries decodes (so that it replays a CUDA graph): prompts get what is left.
        self.max_mixed_tokens = min(max_mixed_tokens or max_num_batched_tokens, max_num_batched_tokens)
        self.max_model_len = max_model_len
        self.hold_steps = hold_steps
        self.steps = 0  # schedule() calls: the clock of held admissions
        self.waiting: deque[Sequence] = deque()  # arrival order (preempted ones first); or by priority (_queue)
        self.running: list[Sequence] = []  # oldest admission first; or by priority (_run)
        # Running sequences whose completions wait for their prompt (Sequence.forks): those hold places in a step
        # already, as they join the running list when the prompt is done (_fork).
        self.forking: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_usage(self) -> float:
        return self.block_manager.usage

    @property
    def num_places_taken(self) -> int:
        """A step's places that running sequences hold: their own and those of their completions still to fork."""
        return len(self.running) + sum(len(seq.forks) for seq in self.forking)

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.steps
        self._queue(seq)

    def _queue(self, seq: Sequence, front: bool = False) -> None:
        """Puts seq in the waiting queue: at its end, or its front (preempted, or a completion going on alone); by
        priority, in (priority, arrival) order, before the equal ones when `front`."""
        if self.by_priority:
            place = bisect.bisect_left if front else bisect.bisect_right
            self.waiting.insert(place(self.waiting, _waiting_key(seq), key=_waiting_key), seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _run(self, seq: Sequence) -> None:
        """Adds seq to the running list: last, or by priority after those of its priority (the last running one is
        always the first to preempt)."""
        if self.by_priority:
            bisect.insort_right(self.running, seq, key=_priority)
        else:
            self.running.append(seq)

    def _hold(self, room: int) -> bool:
        """Whether new requests wait for company: the oldest arrived less than hold_steps steps ago, and the
        prompt tokens waiting do not fill the `room` this step leaves them. Preempted sequences never wait."""
        head = self.waiting[0]
        if head.queue_seconds is not None or self.steps - head.arrival_step >= self.hold_steps:
            return False
        tokens = 0
        for seq in self.waiting:
            tokens += len(seq.token_ids)
            if tokens >= room:
                return False
        return True

    def free(self, seq: Sequence) -> None:
        """Drops a sequence wherever it is (finished, aborted or failed) and frees its blocks. Completions still
        waiting to fork from it go on alone."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq.request_id)
            if seq in self.forking:
                self.forking.remove(seq)
        elif seq.fork_of is not None:
            seq.fork_of.forks.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        for child in seq.forks:
            child.fork_of = None
            self._queue(child, front=True)
        seq.forks = []
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        """Sends seq back to the queue, its completions still to fork with it."""
        self.running.remove(seq)
        self.block_manager.free(seq.request_id)
        if seq in self.forking:
            self.forking.remove(seq)
        seq.status, seq.num_computed_tokens = Status.WAITING, 0
        self._queue(seq, front=True)

    def _fair_share(self, batch: ScheduledBatch) -> tuple[Counter, int] | None:
        """(places each group holds, the share of each) when the sequences that want to run outnumber a step's
        places, after the newest sequences of groups over their share gave up the places that waiting groups under
        theirs want; None when everyone fits."""
        wanted = Counter()
        for seq in self.waiting:
            wanted[seq.group] += 1 + len(seq.forks)
        taken = self.num_places_taken
        if taken + sum(wanted.values()) <= self.max_num_seqs:
            return None
        seats = Counter(seq.group for seq in self.running)
        for seq in self.forking:
            seats[seq.group] += len(seq.forks)
        share = max(1, self.max_num_seqs // len(seats.keys() | wanted.keys()))
        # The places that waiting groups under their share want, each at its sequence's priority, best first. The
        # free places go to the first ones; each of the others may take the place of an over-share sequence of its
        # priority or lower (with fcfs every priority is 0). `need` also counts places taken beyond max_num_seqs.
        room, wants = Counter({g: share - seats[g] for g in wanted}), []
        for seq in self.waiting:
            places = min(room[seq.group], 1 + len(seq.forks))
            if places > 0:
                wants += [_priority(seq)] * places
                room[seq.group] -= places
        wants.sort()
        need = len(wants) - (self.max_num_seqs - taken)
        for seq in reversed(self.running[:]):  # newest (by priority: lowest, newest) first
            # wants[len(wants) - need]: the best want that the free places leave unserved
            if need <= 0 or wants and wants[max(0, len(wants) - need)] > _priority(seq):
                break
            if seq.forks and seats[seq.group] > share:  # its completions still to fork give up their places first
                places = min(len(seq.forks), seats[seq.group] - share, need)
                self._detach_forks(seq, len(seq.forks) - places)
                seats[seq.group] -= places
                need -= places
            if need > 0 and seats[seq.group] > share:
                self._preempt(seq)
                seats[seq.group] -= 1
                need -= 1
                batch.num_preemptions += 1
        return seats, share

    def _running_adapters(self) -> "_AdapterSlots | None":
        """The adapters of the running sequences, when a waiting one asks for an adapter and their number is
        bounded (max_loras); None otherwise."""
        if not self.max_loras or not any(seq.adapter for seq in self.waiting):
            return None
        return _AdapterSlots({seq.adapter for seq in self.running if seq.adapter}, self.max_loras)

    def _fair_order(self, seats: Counter, share: int):
        """The waiting sequences, those of groups under their share first (judged as they come: `seats` grows as
        they are admitted), one priority level after the other (the queue is in priority order)."""
        later = []
        for seq in list(self.waiting):
            if later and _priority(seq) != _priority(later[0]):  # a lower level: the level above goes first
                yield from later
                later = []
            if seats[seq.group] < share:
                yield seq
            else:
                later.append(seq)
        yield from later

    def _trim_forks(self, seq: Sequence, seats: Counter, share: int) -> None:
        """The completions of seq beyond what its group may take now go on alone, later."""
        places = share - seats[seq.group] if seats[seq.group] < share else self.max_num_seqs - self.num_places_taken
        self._detach_forks(seq, max(0, places - 1))

    def _detach_forks(self, seq: Sequence, keep: int) -> None:
        """seq's completions after its first `keep` go to the end of the queue, each its own prompt (the prefix
        cache finds seq's, once computed)."""
        for child in seq.forks[keep:]:
            child.fork_of = None
            self._queue(child)
        del seq.forks[keep:]

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        queried, hits = bm.prefix_queried_tokens, bm.prefix_hit_tokens
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch()
        decodes = 0
        self.steps += 1
        fair = self._fair_share(batch) if self.waiting else None
        made_room = batch.num_preemptions

        def prompt_room(later: int = 0) -> int:
            """Tokens a prompt chunk may take now, leaving one to each of `later` sequences still to schedule."""
            if not decodes:
                return budget - later
            return min(budget, self.max_mixed_tokens - (self.max_num_batched_tokens - budget)) - later

        # The loop below visits every running sequence in every step: what it reads is bound to locals first.
        running, sizes, tables, running_status = list(self.running), bm.num_tokens, bm.tables, Status.RUNNING
        seqs, max_seqs, max_len = batch.seqs, self.max_num_seqs, self.max_model_len
        for i, seq in enumerate(running):
            if budget == 0 or len(seqs) == max_seqs:
                break
            length = len(seq.token_ids)
            # Preempted below while making room for an older one, or its token in flight is its last.
            if seq.status is not running_status or length >= seq.token_limit or length >= max_len:
                continue
            # A decode's new token (sampled last step) needs its slot: grow the table, preempting if needed.
            draft = None
            if length > sizes[seq.request_id]:
                # Speculative draft tokens get slots only while blocks and the budget last: they never preempt.
                draft = seq.draft[:budget - 1] if seq.draft else None
                copies = bm.append(seq.request_id, seq.cache_keys, len(draft)) if draft else None
                if copies is None:
                    draft = None
                    copies = bm.append(seq.request_id, seq.cache_keys)
                while copies is None:  # out of blocks: preempt the newest (lowest-priority) sequences, this one last
                    victim = self.running[-1]
                    self._preempt(victim)
                    batch.num_preemptions += 1
                    if victim is seq:
                        break
                    copies = bm.append(seq.request_id, seq.cache_keys)
                if seq.status is not running_status:
                    continue
                if copies:
                    batch.copies += copies
            n = min(length - seq.num_computed_tokens, budget)
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                decodes += 1
            else:  # a prompt chunk (a long prompt's, or a preempted sequence's)
                n = min(n, prompt_room(later=len(running) - i - 1))
                if n < 1:
                    continue
            if draft:
                batch.add_verify(seq, draft, tables[seq.request_id])
                budget -= 1 + len(draft)
                continue
            batch.add(seq, n, tables[seq.request_id])
            budget -= n
        admit = not (decodes and self.waiting and self.hold_steps and self._hold(prompt_room()))
        order = self._fair_order(*fair) if fair else iter(list(self.waiting) if admit else ())
        adapters = self._running_adapters()
        # A step that preempted for lack of blocks admits nobody; one that made room for fairness does.
        while (admit and self.waiting and prompt_room() > 0 and len(batch.seqs) < self.max_num_seqs
               and self.num_places_taken < self.max_num_seqs and batch.num_preemptions == made_room):
            seq = next(order, None)
            if seq is None:
                break
            if adapters is not None and seq.adapter is not None and not adapters.admits(seq.adapter):
                continue
            if fair:
                self._trim_forks(seq, *fair)
            if (self.num_places_taken + 1 + len(seq.forks) > self.max_num_seqs
                    or not bm.can_allocate(seq.cache_keys)):
                break
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            if fair:
                fair[0][seq.group] += 1 + len(seq.forks)
            cached = bm.allocate(seq.request_id, seq.cache_keys)
            if seq.queue_seconds is None:  # first admission (a preempted sequence comes back here later)
                seq.num_cached_prompt_tokens = cached
                seq.queue_seconds = time.perf_counter() - seq.arrival
            seq.num_computed_tokens, seq.status = cached, Status.RUNNING
            self._run(seq)
            if seq.forks:
                self.forking.append(seq)
            n = min(seq.num_uncomputed_tokens, prompt_room())
            batch.add(seq, n, bm.tables[seq.request_id])
            budget -= n
        for seq, prefill in zip(batch.seqs, batch.is_prefill):
            if prefill and seq.num_computed_tokens == len(seq.token_ids):
                # The prompt's KV is complete once this step runs: publish its full blocks to the prefix cache.
                # Only later steps can hit them (admissions above are done), and the GPU runs those after this one.
                bm.publish(seq.request_id, seq.cache_keys)
                self._fork(seq, batch)
        batch.prefix_queried_tokens = bm.prefix_queried_tokens - queried
        batch.prefix_hit_tokens = bm.prefix_hit_tokens - hits
        return batch

    def accept(self, seq: Sequence, num_accepted: int) -> None:
        """After a verify step, once seq's new tokens are in token_ids: its accepted draft tokens' KV counts as
        computed, and the blocks that only rejected ones reached are given back (their slots past the sequence are
        overwritten as it grows)."""
        seq.num_computed_tokens += num_accepted
        self.block_manager.truncate(seq.request_id, len(seq.token_ids))

    def _fork(self, parent: Sequence, batch: ScheduledBatch) -> None:
        """The completions waiting on parent take its blocks (shared until one writes: copy-on-write) and run."""
        for child in parent.forks:
            self.block_manager.fork(parent.request_id, child.request_id)
            child.fork_of, child.status = None, Status.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_prompt_tokens, child.queue_seconds = parent.num_cached_prompt_tokens, parent.queue_seconds
            self._run(child)
            batch.forks.append((child, parent))
        parent.forks = []
        if parent in self.forking:
            self.forking.remove(parent)


def _priority(seq: Sequence) -> int:
    return seq.params.priority


def _waiting_key(seq: Sequence) -> tuple[int, float]:
    return seq.params.priority, seq.arrival


class _AdapterSlots:
    """One step's admission of sequences that ask for LoRA adapters: at most `limit` distinct adapters run at once.
    Once an adapter must wait for another to leave, later requests for adapters wait too, those already running
    included, so that running adapters' sequences drain and the waiting one gets its turn; requests for the base
    model are never held back."""

    def __init__(self, running: set[str], limit: int):
        self.running, self.limit, self.waiting = running, limit, False

    def admits(self, adapter: str) -> bool:
        if self.waiting or (adapter not in self.running and len(self.running) >= self.limit):
            self.waiting = True
            return False
        self.running.add(adapter)
        return True
