"""Request bodies of the TGI and OpenAI routes. Unknown fields are rejected (a misspelt parameter should not
be silently ignored); parameters the engine cannot honour are accepted only at their neutral value, so that
clients sending them explicitly (huggingface_hub sends several as null) keep working."""
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from service.protocol import MAX_TOP_K

U64 = 2 ** 64


def _only(neutral: Any, hint: str = ""):
    """A parameter this server does not implement: only its neutral value (or null) is accepted."""

    def check(value):
        if value is not None and value != neutral:
            raise ValueError(f"only {neutral!r} is supported by this server{hint}")
        return value

    return AfterValidator(check)


# Unions are resolved by these before-validators rather than by pydantic, whose union errors name the member
# types in the error location ("prompt.str") instead of just the field.

def _stop_strings(value):
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and any(s == "" for s in value):
        raise ValueError("stop strings must be non-empty")
    return value


def _one_prompt(value):
    """A string or a list of token ids; OpenAI's batch forms are accepted holding exactly one prompt."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise ValueError("batched prompts are not supported; send one prompt per request")
        value = value[0]
    if isinstance(value, str) or (isinstance(value, list) and all(type(t) is int for t in value)):
        if not value:
            raise ValueError("must not be empty")
        return value
    raise ValueError("must be a string or an array of token ids")


def _message_text(value):
    """Message content as one string: a string, or a list of text parts."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')


def _token_bias(value):
    """OpenAI's logit_bias: token ids as JSON object keys (strings) -> int keys."""
    if value is None:
        return value
    if not all(isinstance(k, str) and k.isdigit() and int(k) < 2**31 for k in value):
        raise ValueError("keys must be token ids (strings of digits)")
    return {int(k): v for k, v in value.items()}


Stop = Annotated[list[str] | None, BeforeValidator(_stop_strings)]
Penalty = Annotated[float | None, Field(ge=-2, le=2)]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]] | None, AfterValidator(_token_bias)]


class _Body(BaseModel):
    # strict: "5" is no integer and "yes" no boolean (a client sending them has a bug worth seeing)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# -- text-generation-inference ----------------------------------------------------------------------------

class TGIParameters(_Body):
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, gt=0)
    top_k: int | None = Field(None, ge=1, le=MAX_TOP_K)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    do_sample: bool = False
    seed: int | None = Field(None, ge=0, lt=U64)
    stop: Stop = None
    details: bool = False
    return_full_text: bool = False
    decoder_input_details: bool = False
    adapter_id: str | None = None
    truncate: int | None = Field(None, ge=1)
    ignore_eos: bool = False  # an extension (as vLLM's): generate max_new_tokens whatever the model says
    best_of: Annotated[int | None, _only(1)] = None
    top_n_tokens: Annotated[int | None, _only(0)] = None
    typical_p: Annotated[float | None, _only(1.0)] = None
    frequency_penalty: Penalty = None
    watermark: Annotated[bool | None, _only(False)] = None
    grammar: Annotated[dict | None, _only(None)] = None


class TGIRequest(_Body):
    inputs: str = Field(min_length=1)
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False  # only read by POST /, which serves both


# -- OpenAI -------------------------------------------------------------------------------------------------

class StreamOptions(_Body):
    include_usage: bool = False


class OpenAIRequest(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: Annotated[int, Field(ge=1), _only(1, "; send n separate requests")] = 1
    stop: Stop = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=U64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    logit_bias: LogitBias = None
    user: str | None = None
    # extensions (as in vLLM)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0, lt=2**31)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False


class CompletionRequest(OpenAIRequest):
    prompt: Annotated[str | list[int], BeforeValidator(_one_prompt)]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: Annotated[int | None, _only(1)] = None
    suffix: Annotated[str | None, _only(None)] = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | None, BeforeValidator(_message_text)] = None
    name: str | None = None


class ResponseFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: Annotated[list | None, _only([], " (no tool calling)")] = None
    tool_choice: Annotated[str | None, _only("none", " (no tool calling)")] = None


# -- tokenization ------------------------------------------------------------------------------------------

class TGITokenizeRequest(_Body):
    """TGI's POST /tokenize."""
    inputs: str = Field(min_length=1)
    parameters: TGIParameters | None = None  # accepted as TGI clients send them; tokenizing reads none


class TokenizeRequest(_Body):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered by the model's template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=2**31)]]
