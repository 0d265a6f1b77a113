"""What the engine streams back for a request: one TokenOutput per generated token."""
from dataclasses import dataclass


@dataclass
class TokenOutput:
    request_id: str
    token_id: int
    text: str  # the detokenized text this token completes (may be "" while a UTF-8 char is split)
    logprob: float | None
    special: bool
    index: int  # 0-based position among generated tokens
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "eos_token" once finished
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    top_logprobs: list[tuple[int, float]] | None = None
    queue_seconds: float | None = None  # on the first token: how long the request waited to be scheduled


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
