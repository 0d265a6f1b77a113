"""vLLM's routes for serving LoRA adapters without a restart: POST /v1/load_lora_adapter {"lora_name", "lora_path"}
and POST /v1/unload_lora_adapter {"lora_name"}, with vLLM's answers (200 with a line of text) and errors (400 for a
name already served, 404 for an unknown one or a path with nothing at it), in our OpenAI error shape. The path is
on the server: a PEFT adapter's directory, or one of our adapter files (service.model.peft).

Every engine core loads and unloads the adapter (EngineClient.call_all), so each can serve it; a load that fails on
some core is undone on the cores where it succeeded, so they all serve the same adapters. An adapter unloaded while
requests use it serves them to their end; new requests for it get 404 at once. Route group "finetune" (the API key).
"""
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from service.api.auth import require_api_key
from service.api.body import read_json
from service.api.engine_client import CallError
from service.api.errors import APIError
from service.api.generation import engine
from service.api.openai_routes import BASE_MODEL_ALIASES

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key("finetune"))])
log = logging.getLogger("service.api")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str


def _api_error(e: CallError) -> APIError:
    return APIError(e.error["status"], e.error["message"], param=e.error["param"], code=e.error["code"])


@router.post("/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(request: Request):
    body = await read_json(request, LoadLoRAAdapterRequest, request.app.state.settings.max_request_bytes)
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", code="invalid_value")
    if body.lora_name in BASE_MODEL_ALIASES:  # the engine refuses the base model's own name
        raise APIError(400, f"'{body.lora_name}' stands for the base model in requests (TGI clients send it)",
                       param="lora_name", code="invalid_value")
    client = engine(request)
    try:
        await client.call_all("load_adapter", name=body.lora_name, path=body.lora_path)
    except CallError as e:
        if e.succeeded:  # every core serves the same adapters: the cores that did load it unload it again
            try:
                await client.call_all("unload_adapter", e.succeeded, name=body.lora_name)
            except CallError as undo:
                log.error("adapter %s stays loaded on engine cores %s: %s", body.lora_name,
                          [core.index for core in e.succeeded], undo)
        raise _api_error(e) from None
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(request: Request):
    body = await read_json(request, UnloadLoRAAdapterRequest, request.app.state.settings.max_request_bytes)
    if not body.lora_name:
        raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", code="invalid_value")
    try:
        await engine(request).call_all("unload_adapter", name=body.lora_name)
    except CallError as e:
        # Unknown to some cores only: a fine-tuning job's adapter those had not loaded yet. It is gone everywhere.
        if not (e.succeeded and e.error["status"] == 404):
            raise _api_error(e) from None
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
