"""Request bodies of the TGI and OpenAI routes. Unknown fields are rejected (a misspelt parameter should not
be silently ignored); parameters the engine cannot honour are accepted only at their neutral value, so that
clients sending them explicitly (huggingface_hub sends several as null) keep working."""
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag
from pydantic_core import core_schema

from service.protocol import MAX_TOP_K

U64 = 2 ** 64
# A request's priority (scheduling_policy "priority"): lower values are served first, as in vLLM; 0 is the default and
# the only value a server scheduling first come, first served accepts.
Priority = Annotated[int, Field(ge=-(2 ** 63), lt=2 ** 63)]
MAX_CHOICES = 128  # n and best_of (the engine also caps them at its batch size)


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


MAX_PROMPTS = 256  # prompts in one /v1/completions request


def _prompts(value):
    """OpenAI's prompt: a string, a list of token ids, or a list of either (a batch) -> a list of prompts."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(type(t) is int for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, an array of token ids, or a non-empty array of those")
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
    for prompt in value:
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))):
            raise ValueError("each prompt must be a string or an array of token ids")
        if not prompt:
            raise ValueError("prompts must not be empty")
    return value


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
    if not all(isinstance(k, str) and k.isascii() and k.isdigit() and int(k) < 2**31 for k in value):
        raise ValueError("keys must be token ids (strings of digits)")
    return {int(k): v for k, v in value.items()}


Stop = Annotated[list[str] | None, BeforeValidator(_stop_strings)]
Penalty = Annotated[float | None, Field(ge=-2, le=2)]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]] | None, AfterValidator(_token_bias)]


class _Body(BaseModel):
    # strict: "5" is no integer and "yes" no boolean (a client sending them has a bug worth seeing)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# -- text-generation-inference ----------------------------------------------------------------------------

class TGIGrammar(_Body):
    type: Literal["json", "json_schema", "regex"]
    value: dict | str  # json: a JSON schema (or its text); regex: a regular expression


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
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    priority: Priority = 0  # an extension (as vLLM's on its OpenAI routes)
    top_n_tokens: Annotated[int | None, _only(0)] = None
    typical_p: Annotated[float | None, _only(1.0)] = None
    frequency_penalty: Penalty = None
    watermark: Annotated[bool | None, _only(False)] = None
    grammar: TGIGrammar | None = None


class TGIRequest(_Body):
    inputs: str = Field(min_length=1)
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False  # only read by POST /, which serves both


# -- OpenAI -------------------------------------------------------------------------------------------------

class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class OpenAIRequest(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
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
    response_format: ResponseFormat | None = None
    priority: Priority = 0


class CompletionRequest(OpenAIRequest):
    prompt: Annotated[list, BeforeValidator(_prompts)]  # strings or token-id lists (see _prompts)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: Annotated[str | None, _only(None)] = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | None, BeforeValidator(_message_text)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    # What the openai client echoes back when a response's message is sent again: accepted, not used.
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


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
    tools: list[Tool] | None = Field(None, max_length=128)  # rendered with the messages, as chat renders them
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=2**31)]]


# -- OpenAI Responses API (stateless) -------------------------------------------------------------------------

class _OrText:
    """A field that also takes a text, which `wrap` turns into its value before validation: errors then name the
    field, not a member of a union, and the JSON schema offers both."""

    def __init__(self, wrap):
        self.wrap = wrap

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.no_info_before_validator_function(
            lambda value: self.wrap(value) if isinstance(value, str) else value, handler(source))

    def __get_pydantic_json_schema__(self, schema, handler):
        return {"anyOf": [{"type": "string"}, handler(schema)]}


ItemStatus = Literal["in_progress", "completed", "incomplete"] | None


class TextPart(_Body):
    """Text in an input item; output_text is a previous response's message sent back."""
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # what a previous response's output_text holds: accepted, not used
    logprobs: list | None = None


TextParts = Annotated[list[TextPart], _OrText(lambda text: [{"type": "input_text", "text": text}])]


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: TextParts
    id: str | None = None  # a previous response's message sent back: accepted, not used
    status: ItemStatus = None


class FunctionCallItem(_Body):
    """A call a previous response made, sent back with its output."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: ItemStatus = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: TextParts
    id: str | None = None
    status: ItemStatus = None


def _item_type(value) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else None  # an easy message has no type


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                      Discriminator(_item_type, custom_error_type="invalid_item",
                                    custom_error_message="must be a message, function_call or function_call_output "
                                                         "item")]


class FunctionTool(_Body):
    """The Responses API's function tool: a chat tool's function, flat (its type first: an unknown tool type is the
    error a client needs to see, before any missing field)."""
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)  # json_schema: required
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str
    input: Annotated[list[InputItem], Field(min_length=1), _OrText(lambda text: [{"role": "user", "content": text}])]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true
    text: TextConfig | None = None
    stream: bool = False
    user: str | None = None
    priority: Priority = 0  # an extension, as on the other OpenAI routes (vLLM's)
    # OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512; echoed in the response
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)
    # Nothing is kept: only their neutral values are served (the route says why otherwise).
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
