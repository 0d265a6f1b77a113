"""What crosses the boundary between the HTTP front-ends and the engine core: typed messages, encoded with msgpack
(msgspec) over ZeroMQ. No pickle: a front-end and the core only ever exchange these structs.

    front-end -> core   Hello, AddRequest, Abort, Call
    core -> front-end   EngineInfo, Admitted, StepOutputs, Reply, AdaptersChanged

The core owns a ROUTER socket; each front-end connects a DEALER, so the core answers each front-end alone and
sends it, once per engine step, one StepOutputs with the new tokens of all its requests.
"""
from typing import Any

import msgspec

# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32 (1e-45 is already
# 0 there), and the distribution it asks for is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # any k beyond the vocabulary keeps every token


class Grammar(msgspec.Struct, array_like=True):
    """What the output must match (structured outputs): kind "json" (value: a JSON schema, or "" for any JSON
    object) or "regex" (value: a regular expression)."""
    kind: str
    value: str = ""


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """What a request asks of generation, independent of the HTTP schema that carried it. The engine core reads
    the sampling fields and the token-level stops; stop strings are matched by the front-end on the text."""
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 (or anything below GREEDY_TEMPERATURE) means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # > 1 discourages every token of the prompt and the output
    frequency_penalty: float = 0.0  # subtracted from a token's logit once per time it was generated
    presence_penalty: float = 0.0  # subtracted once from the logit of every token generated so far
    logit_bias: dict[int, float] = {}  # added to those tokens' logits
    min_p: float = 0.0  # drops tokens less likely than min_p times the most likely one
    min_tokens: int = 0  # EOS and stop_token_ids cannot end generation before this many tokens
    seed: int | None = None  # same seed -> same tokens
    stop: list[str] = []
    include_stop_str_in_output: bool = False  # TGI returns the stop string, OpenAI does not
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False  # report the sampled token's logprob
    top_logprobs: int = 0
    grammar: Grammar | None = None
    n: int = 1  # completions of one prompt: they share its KV blocks, and child i draws with seed + i
    priority: int = 0  # scheduling_policy "priority": lower values are served first (vLLM's convention)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing to adjust or constrain: the token is the argmax of the logits as they are (and its
        logprob, when asked, comes from the same logits). Top logprobs take the general path."""
        return (self.greedy and not self.needs_history and not self.logit_bias and not self.min_tokens
                and not self.top_logprobs)

    @property
    def needs_history(self) -> bool:
        """The penalties and grammars read the tokens generated so far: the host must know the last one before
        sampling."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.grammar is not None)


def choice_seed(seed: int, index: int) -> int:
    """The seed of a request's completion `index` (n > 1, best_of): the request's seed + index, wrapped to 64 bits."""
    return (seed + index) % 2**64


def choice_ids(request_id: str, n: int) -> list[str]:
    """The engine's ids of a request's n completions: the request's own id, then one per further completion."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


# -- front-end -> core ------------------------------------------------------------------------------------

class Hello(msgspec.Struct, tag=True, array_like=True):
    """A front-end announces itself; the core answers with EngineInfo once it serves."""


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    group: str = ""  # whose share of a step it counts against (one HTTP request, or one OpenAI `user`); "": its own


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Call(msgspec.Struct, tag=True, array_like=True):
    """A remote call into the core (fine-tuning jobs and files, on core 0; loading and unloading LoRA adapters, on
    every core); answered by a Reply with the same call_id."""
    call_id: int
    method: str
    kwargs: dict[str, Any] = {}


# -- core -> front-end ------------------------------------------------------------------------------------

class EngineInfo(msgspec.Struct, tag=True, array_like=True):
    model_name: str
    model_dir: str  # where the front-end loads the tokenizer from (the core resolved and downloaded it)
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int
    adapters: list[str]  # the LoRA adapters this core serves, by name (the model names of /v1/models)


class Rejection(msgspec.Struct, array_like=True):
    request_id: str
    # "overloaded" (HTTP 429), "invalid" (HTTP 422), "grammar" (the grammar does not compile: 400) or "adapter" (the
    # adapter it names is not served, unloaded before the front-end heard: 404)
    reason: str
    message: str


class Admitted(msgspec.Struct, tag=True, array_like=True):
    """The core's answer to the AddRequests it drained: accepted ids and rejections."""
    accepted: list[str]
    rejected: list[Rejection]


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's new token in one step (or its failure)."""
    request_id: str
    token_id: int = -1
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "length" | "stop" | "eos_token" | "abort"
    prompt_tokens: int = 0  # on the first token
    cached_prompt_tokens: int = 0  # on the first token
    queue_seconds: float | None = None  # on the first token: how long the request waited to be scheduled
    error: str | None = None  # the request failed inside the engine (HTTP 500)
    error_code: str | None = None  # "invalid_grammar": failed on its grammar, which allows no token (HTTP 400)


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[RequestOutput]


class Reply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any = None
    error: dict | None = None  # {"status", "message", "param", "code"}: becomes the HTTP error


class AdaptersChanged(msgspec.Struct, tag=True, array_like=True):
    """The adapters the core serves now, after a load or an unload. published: a finished fine-tuning job's
    adapter (name: file), sent to one front-end, which has the other cores load it too."""
    adapters: list[str]
    published: dict[str, str] = {}


ToCore = Hello | AddRequest | Abort | Call
ToFrontend = EngineInfo | Admitted | StepOutputs | Reply | AdaptersChanged


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToCore)


def frontend_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToFrontend)

