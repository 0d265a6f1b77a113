"""OpenAI-compatible /v1/files and /v1/fine_tuning/jobs, over the JobManager at app.state.finetune."""
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from service.api.auth import require_api_key
from service.api.body import read_json
from service.api.errors import APIError
from service.finetune.jobs import JobError, JobManager

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key("finetune"))])
UPLOAD_OVERHEAD = 64 << 10  # multipart framing around the file


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hyperparameters(_Strict):
    n_epochs: Literal["auto"] | int | None = Field(None, ge=1, le=100)
    batch_size: Literal["auto"] | int | None = Field(None, ge=1, le=256)
    learning_rate_multiplier: Literal["auto"] | float | None = Field(None, gt=0, allow_inf_nan=False)


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
    metadata: dict[str, str] | None = None
    integrations: list[dict] | None = None
    extra: Extra | None = None


def _manager(request: Request) -> JobManager:
    manager = getattr(request.app.state, "finetune", None)
    if manager is None:
        raise APIError(503, "fine-tuning is not available yet (the server is starting)")
    return manager


def _call(fn, *args):
    try:
        return fn(*args)
    except JobError as e:
        raise APIError(e.status, e.message, param=e.param, code=e.code) from None


async def _await(coroutine):
    try:
        return await coroutine
    except JobError as e:
        raise APIError(e.status, e.message, param=e.param, code=e.code) from None


@router.post("/files")
async def create_file(request: Request):
    manager = _manager(request)
    limit = manager.settings.finetune_max_file_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + UPLOAD_OVERHEAD:
        raise APIError(413, f"the file is larger than {limit} bytes", param="file")
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as e:  # starlette's MultiPartException and friends: a malformed body
        raise APIError(400, f"expected a multipart/form-data body with `file` and `purpose`: {e}") from None
    upload, purpose = form.get("file"), form.get("purpose")
    if upload is None or isinstance(upload, str):
        raise APIError(400, "the form has no `file` part", param="file")
    if not isinstance(purpose, str):
        raise APIError(400, "the form has no `purpose` field", param="purpose")
    data = await upload.read(limit + 1)
    await form.close()
    return await _await(manager.create_file(upload.filename or "upload.jsonl", purpose, data))


@router.get("/files")
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(10000, ge=1, le=10000)):
    return _manager(request).list_files(purpose, after, limit)


@router.get("/files/{file_id}")
async def retrieve_file(request: Request, file_id: str):
    return _call(_manager(request).get_file, file_id)


@router.post("/fine_tuning/jobs")
async def create_job(request: Request):
    manager = _manager(request)
    req = await read_json(request, CreateJobRequest, manager.settings.max_request_bytes)
    return await _await(manager.create_job(req.model_dump(exclude_none=True)))


@router.get("/fine_tuning/jobs")
async def list_jobs(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=1000)):
    return _manager(request).list_jobs(after, limit)


@router.get("/fine_tuning/jobs/{job_id}")
async def retrieve_job(request: Request, job_id: str):
    return _call(_manager(request).get_job, job_id)


@router.post("/fine_tuning/jobs/{job_id}/cancel")
async def cancel_job(request: Request, job_id: str):
    return _call(_manager(request).cancel_job, job_id)


@router.get("/fine_tuning/jobs/{job_id}/events")
async def list_events(request: Request, job_id: str, after: str | None = None,
                      limit: int = Query(20, ge=1, le=10000)):
    return _call(_manager(request).list_events, job_id, after, limit)
