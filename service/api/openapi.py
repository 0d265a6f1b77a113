"""The service's OpenAPI description (/openapi.json, /docs). The routes read and check their bodies themselves
(service.api.body, so that errors have the service's shapes), so FastAPI sees no body parameter to describe: this
adds each route's body schema from the pydantic models the route validates with, the error answers in the
route's dialect, the streaming and text media types, and the limits a request can meet (with this server's
settings)."""
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from service.api.adapter_routes import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from service.api.finetune_routes import CreateJobRequest
from service.api.schemas import (
    MAX_CHOICES,
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TGIRequest,
    TGITokenizeRequest,
    TokenizeRequest,
)
from service.config import LIMITS

BODIES = {("/", "post"): TGIRequest, ("/generate", "post"): TGIRequest, ("/generate_stream", "post"): TGIRequest,
          ("/v1/completions", "post"): CompletionRequest, ("/v1/chat/completions", "post"): ChatCompletionRequest,
          ("/v1/responses", "post"): ResponsesRequest,
          ("/v1/fine_tuning/jobs", "post"): CreateJobRequest, ("/detokenize", "post"): DetokenizeRequest,
          ("/tokenize", "post"): (TGITokenizeRequest, TokenizeRequest),  # a tuple: either body
          ("/v1/load_lora_adapter", "post"): LoadLoRAAdapterRequest,
          ("/v1/unload_lora_adapter", "post"): UnloadLoRAAdapterRequest}
# Routes answering with server-sent events: always (True), or when the body asks for a stream (False).
STREAMS = {"/": False, "/generate_stream": True, "/v1/completions": False, "/v1/chat/completions": False,
           "/v1/responses": False}
SSE_EVENT = {"type": "object", "required": ["data"],  # data: a JSON event (a token, a chunk, an error) or [DONE]
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
ERROR_STATUSES = {"400": "Bad request", "401": "Missing or wrong API key", "404": "Not found",
                  "408": "The body did not arrive in time", "413": "Body too large", "422": "Invalid request",
                  "429": "Overloaded", "500": "The engine failed", "503": "Not serving (starting, draining)"}


class TGIError(BaseModel):
    error: str
    error_type: str


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


def _ref(model: type[BaseModel], components: dict) -> dict:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def limits_description(settings) -> str:
    """The limits a request can meet, as a Markdown table, with these settings' values."""
    rows = [f"| `{name}` | {getattr(settings, name)} | {what} | {beyond} |" for name, what, beyond in LIMITS]
    rows += [f"| - | {MAX_CHOICES} | n and best_of | 422 |", f"| - | {MAX_PROMPTS} | prompts of a /v1/completions "
             "request | 422 |"]
    return "\n".join(["Limits (the settings of this server):", "", "| setting | value | bounds | beyond it |",
                      "|---|---|---|---|", *rows])


def openapi_schema(app: FastAPI) -> dict:
    schema = get_openapi(title=app.title, version="1", routes=app.routes,
                         description=limits_description(app.state.settings))
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    errors = {"tgi": _ref(TGIError, components), "openai": _ref(OpenAIError, components)}
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    for path, operations in schema["paths"].items():
        error = errors["openai" if path.startswith("/v1/") else "tgi"]
        for method, operation in operations.items():
            if (path, method) in BODIES:
                models = BODIES[path, method]
                body = ({"oneOf": [_ref(m, components) for m in models]} if isinstance(models, tuple)
                        else _ref(models, components))
                operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
            responses = operation.setdefault("responses", {})
            for status, description in ERROR_STATUSES.items():
                responses[status] = {"description": description, "content": {"application/json": {"schema": error}}}
            if path in STREAMS and method == "post":
                content = responses["200"]["content"]
                if STREAMS[path]:
                    content.clear()
                content["text/event-stream"] = {"schema": SSE_EVENT}
    schema["paths"]["/v1/files"]["post"]["requestBody"] = {"required": True, "content": {"multipart/form-data": {
        "schema": {"type": "object", "required": ["file", "purpose"],
                   "properties": {"file": {"type": "string", "format": "binary"},
                                  "purpose": {"type": "string", "enum": ["fine-tune"]}}}}}}
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return schema
