"""OpenAI-compatible /v1/files and /v1/fine_tuning/jobs. The front-end does the work that would stall the engine
core's loop (reading uploads, checking and tokenizing training data) and the core's JobManager
(service.engine.finetune_jobs) keeps the files' and jobs' state, so every front-end sees the same."""
import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.formparsers import MultiPartException, MultiPartParser

from service.api.auth import require_api_key
from service.api.body import limited_stream, read_json
from service.api.engine_client import CallError
from service.api.errors import APIError
from service.api.generation import engine
from service.api.training_data import TrainingDataWorker, remove_quietly

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key("finetune"))])
UPLOAD_OVERHEAD = 64 << 10  # multipart framing around the file


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Hyperparameters(_Strict):
    # The bounds belong to the numbers: on the whole union they would compare "auto" with a number.
    n_epochs: Literal["auto"] | Annotated[int, Field(ge=1, le=100)] | None = None
    batch_size: Literal["auto"] | Annotated[int, Field(ge=1, le=256)] | None = None
    learning_rate_multiplier: Literal["auto"] | Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None


class Supervised(_Strict):
    hyperparameters: Hyperparameters | None = None


class Method(_Strict):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: Supervised | None = None
    dpo: dict | None = None
    reinforcement: dict | None = None


class Extra(_Strict):
    """Our own options (send with the openai client as extra_body={"extra": {...}})."""
    type: Literal["lora", "full"] = "lora"
    lora_rank: int | None = Field(None, ge=1, le=1024)
    lora_alpha: float | None = Field(None, gt=0, allow_inf_nan=False)
    target_modules: list[str] | None = None
    max_steps: int | None = Field(None, ge=1)
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    warmup_steps: int | None = Field(None, ge=0)


class CreateJobRequest(_Strict):
    model: str
    training_file: str
    validation_file: str | None = None
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: str | None = None
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    # OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)
    integrations: list[dict] | None = None
    extra: Extra | None = None


async def _call(request: Request, method: str, **kwargs):
    try:
        return await engine(request).call(method, **kwargs)
    except CallError as e:
        raise APIError(e.error["status"], e.error["message"], param=e.error["param"], code=e.error["code"]) from None


def _files_dir(request: Request) -> Path:
    path = Path(request.app.state.settings.finetune_dir) / "files"
    path.mkdir(parents=True, exist_ok=True)
    return path


@router.post("/files")
async def create_file(request: Request):
    limit = request.app.state.settings.finetune_max_file_bytes
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, "expected a multipart/form-data body with `file` and `purpose`")
    # Parsed as it streams in, so the limit holds for chunked uploads too (nothing past it is spooled to disk).
    parser = MultiPartParser(request.headers, limited_stream(request, limit + UPLOAD_OVERHEAD, "the file"),
                             max_files=1, max_fields=8)
    try:
        form = await parser.parse()
    except MultiPartException as e:  # a malformed body
        raise APIError(400, f"expected a multipart/form-data body with `file` and `purpose`: {e}") from None
    upload, purpose = form.get("file"), form.get("purpose")
    if upload is None or isinstance(upload, str):
        raise APIError(400, "the form has no `file` part", param="file")
    if not isinstance(purpose, str):
        raise APIError(400, "the form has no `purpose` field", param="purpose")
    data = await upload.read(limit + 1)
    filename = upload.filename or "upload.jsonl"
    await form.close()
    if purpose != "fine-tune":
        raise APIError(400, f"purpose must be 'fine-tune', got {purpose!r}", param="purpose")
    if len(data) > limit:
        raise APIError(413, f"the file is larger than {limit} bytes", param="file")
    file_id = f"file-{uuid.uuid4().hex[:24]}"
    path = _files_dir(request) / f"{file_id}.jsonl"
    staged = path.with_name(path.name + ".tmp")
    await asyncio.to_thread(staged.write_bytes, data)
    try:
        await _worker(request).check_upload(staged, request.app.state.settings.finetune_max_messages)
    except ValueError as e:
        remove_quietly(staged)
        raise APIError(400, f"invalid training file {filename!r}: {e}", param="file", code="invalid_file") from None
    os.replace(staged, path)
    meta = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
            "filename": filename, "purpose": purpose, "status": "processed", "status_details": None,
            "expires_at": None}
    try:
        return await _call(request, "register_file", meta=meta)
    except APIError:  # refused (the server's file limit): keep nothing of it
        remove_quietly(path)
        raise


def _worker(request: Request) -> TrainingDataWorker:
    state = request.app.state
    if state.training_data is None:
        state.training_data = TrainingDataWorker(engine(request).info.model_dir)
    return state.training_data


@router.get("/files")
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(10000, ge=1, le=10000)):
    return await _call(request, "list_files", purpose=purpose, after=after, limit=limit)


@router.get("/files/{file_id}")
async def retrieve_file(request: Request, file_id: str):
    return await _call(request, "get_file", file_id=file_id)


@router.delete("/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    return await _call(request, "delete_file", file_id=file_id)


async def _tokenize_file(request: Request, file_id: str, param: str) -> int:
    """Checks and tokenizes a training file for a job, storing its examples for the core: their number."""
    client = engine(request)
    await _call(request, "get_file", file_id=file_id, param=param)
    try:
        return await _worker(request).tokenize_file(_files_dir(request), file_id, client.max_model_len,
                                                    request.app.state.settings.finetune_max_messages)
    except ValueError as e:
        raise APIError(400, f"{param} {file_id}: {e}", param=param, code="invalid_file") from None


@router.post("/fine_tuning/jobs")
async def create_job(request: Request):
    req = await read_json(request, CreateJobRequest, request.app.state.settings.max_request_bytes)
    body = req.model_dump(exclude_none=True)
    num_examples = await _tokenize_file(request, req.training_file, "training_file")
    if req.validation_file:
        await _tokenize_file(request, req.validation_file, "validation_file")
    return await _call(request, "create_job", body=body, num_examples=num_examples)


@router.get("/fine_tuning/jobs")
async def list_jobs(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=1000)):
    return await _call(request, "list_jobs", after=after, limit=limit)


@router.get("/fine_tuning/jobs/{job_id}")
async def retrieve_job(request: Request, job_id: str):
    return await _call(request, "get_job", job_id=job_id)


@router.post("/fine_tuning/jobs/{job_id}/cancel")
async def cancel_job(request: Request, job_id: str):
    return await _call(request, "cancel_job", job_id=job_id)


@router.get("/fine_tuning/jobs/{job_id}/events")
async def list_events(request: Request, job_id: str, after: str | None = None,
                      limit: int = Query(20, ge=1, le=10000)):
    return await _call(request, "list_events", job_id=job_id, after=after, limit=limit)
