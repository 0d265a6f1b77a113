"""One request's state as it moves through the engine core."""
import enum
import time
from dataclasses import dataclass, field

import torch

from service.protocol import SamplingParams

PENDING = -1  # token id of a sampled token still on the GPU (see Sequence.pending_row)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None  # seeded requests only
    adapter: str | None = None
    group: str = ""  # the request (or client) whose share of each step it counts against
    token_ids: list[int] = field(init=False)  # prompt + generated
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or is being written by the step in flight)
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at first admission
    arrival: float = field(default_factory=time.perf_counter)
    queue_seconds: float | None = None  # arrival until first scheduled; None while never admitted
    arrival_step: int = 0  # the scheduler's step count when it arrived (admissions wait a few steps for company)
    # With overlapped scheduling the step in flight has sampled this sequence's last token, but its value is still
    # on the GPU: token_ids[-1] is PENDING and pending_row is its row in that step's sampled tokens. The next step
    # reads its input from there on the device; the host learns the value when the step completes.
    pending_row: int = -1
    matcher: object = None  # the grammar's xgrammar matcher, advanced by every generated token
    grammar: object = None  # the compiled grammar, counted among those of running requests while this one lives
    # n > 1: the other completions wait here, without KV blocks, until this one's prompt is computed; the
    # scheduler then forks them (they share its blocks, copy-on-write) in the step that samples its first token.
    forks: list["Sequence"] = field(default_factory=list)
    fork_of: "Sequence | None" = None  # while waiting in fork_of.forks
    # Speculative decoding: tokens proposed to follow token_ids, set before each step is scheduled. The step scores
    # them beside the last token; they join token_ids only as far as verification accepts them.
    draft: list[int] = field(default_factory=list)

    # Plain attributes, not properties: the scheduler reads them for every running sequence in every step.
    num_prompt_tokens: int = field(init=False)
    token_limit: int = field(init=False)  # prompt + max_new_tokens: the most tokens it may reach
    argmax_only: bool = field(init=False)  # params.argmax_only

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.token_limit = self.num_prompt_tokens + self.params.max_new_tokens
        self.argmax_only = self.params.argmax_only

    @property
    def cache_keys(self):
        """What the prefix cache hashes: the tokens, salted with the adapter (its KV differs from the base
        model's) through the first token, which every chained block hash includes."""
        if self.adapter is None:
            return self.token_ids
        return SaltedTokens(self.adapter, self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


class SaltedTokens:
    """tokens with the first one read as (salt, token): a view, so that the scheduler's every step does not copy an
    adapter's sequence (the block manager takes its length and slices of it)."""
    __slots__ = ("salt", "tokens")

    def __init__(self, salt: str, tokens: list[int]):
        self.salt, self.tokens = salt, tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        if isinstance(index, slice):
            positions, items = range(*index.indices(len(self.tokens))), self.tokens[index]
            if 0 in positions:
                items[positions.index(0)] = (self.salt, self.tokens[0])
            return items
        if index in (0, -len(self.tokens)):
            return self.salt, self.tokens[0]
        return self.tokens[index]
