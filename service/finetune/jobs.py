"""Fine-tuning jobs and their files, kept on disk under settings.finetune_dir so a restarted server lists them
and serves their adapters again:

    files/<file-id>.jsonl, files/<file-id>.json            uploaded data and its metadata
    jobs/<job-id>/job.json                                  the job (the OpenAI fine_tuning.job object + ours)
    jobs/<job-id>/events.jsonl                              its events, oldest first
    jobs/<job-id>/adapter.safetensors                       the trained adapter (written atomically)

Jobs run one at a time in a background asyncio task of the serving process, on the served model's GPU. Each
micro-batch runs in a worker thread; between two of them the task yields to serving: while the engine has
requests (running or waiting) it sleeps so that training takes at most `finetune_duty_cycle` of the time (by
default half: a pause as long as the micro-batch just done), and runs back to back when the engine is idle.
A finished job's adapter is added to the served model under its fine_tuned_model name at once.
"""
import asyncio
import json
import logging
import os
import random
import re
import time
import uuid
from pathlib import Path

import torch

from service.engine.async_engine import cancel_and_wait
from service.finetune.data import parse_jsonl, tokenize_records
from service.finetune.lora import TARGETS, Adapter, LoRAConfig, add_adapter
from service.finetune.trainer import StepResult, Trainer, TrainConfig, TrainingDiverged

log = logging.getLogger(__name__)

BASE_LEARNING_RATE = {"lora": 1e-3, "full": 1e-4}  # times hyperparameters.learning_rate_multiplier
MAX_FULL_FINETUNE_PARAMS = 1_000_000_000  # full fine-tuning keeps an fp32 copy + AdamW state of each projection
FINISHED = ("succeeded", "failed", "cancelled")
_SUFFIX = re.compile(r"[A-Za-z0-9_-]{1,40}")


class JobError(Exception):
    """A request the manager refuses: becomes an HTTP error with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _page(items: list[dict], after: str | None, limit: int) -> dict:
    """An OpenAI cursor page of items (already newest first): those after the item with id `after`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    data = items[:limit]
    return {"object": "list", "data": data, "has_more": len(items) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


class JobManager:
    def __init__(self, settings, engine, metrics=None):
        self.settings, self.engine, self.metrics = settings, engine, metrics
        self.root = Path(settings.finetune_dir)
        self.files_dir, self.jobs_dir = self.root / "files", self.root / "jobs"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.files = {p.stem: json.loads(p.read_text()) for p in sorted(self.files_dir.glob("*.json"))}
        self.jobs = {p.parent.name: json.loads(p.read_text()) for p in sorted(self.jobs_dir.glob("*/job.json"))}
        self._cancelled: set[str] = set()
        self._queue: asyncio.Queue[str] | None = None
        self._task: asyncio.Task | None = None

    @property
    def model(self):
        return self.engine.engine.model

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serves the adapters of succeeded jobs, fails jobs a previous server left running, queues the rest."""
        self._queue = asyncio.Queue()
        for job in sorted(self.jobs.values(), key=lambda j: j["created_at"]):
            if job["status"] == "succeeded":
                try:
                    await asyncio.to_thread(self._serve_adapter, job)
                except Exception as e:  # a damaged adapter must not keep the server from starting
                    log.exception("cannot serve the adapter of %s", job["id"])
                    self._finish(job, "failed", error=("adapter_unavailable", f"the adapter cannot be loaded: {e}"))
            elif job["status"] == "running":
                self._finish(job, "failed", error=("interrupted", "the server restarted while the job was running"))
            elif job["status"] == "queued":
                self._queue.put_nowait(job["id"])
        self._update_job_gauge()
        self._task = asyncio.create_task(self._worker(), name="finetune-worker")

    async def shutdown(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def served_models(self) -> list[str]:
        return [j["fine_tuned_model"] for j in self.jobs.values() if j["status"] == "succeeded"]

    # -- files -------------------------------------------------------------------------------------------
    async def create_file(self, filename: str, purpose: str, data: bytes) -> dict:
        if purpose != "fine-tune":
            raise JobError(400, f"purpose must be 'fine-tune', got {purpose!r}", param="purpose")
        if len(data) > self.settings.finetune_max_file_bytes:
            raise JobError(413, f"the file is larger than {self.settings.finetune_max_file_bytes} bytes", param="file")
        try:
            await asyncio.to_thread(parse_jsonl, data)
        except ValueError as e:
            raise JobError(400, f"invalid training file {filename!r}: {e}", param="file", code="invalid_file") from None
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        meta = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed", "status_details": None,
                "expires_at": None}
        tmp = self.files_dir / f"{file_id}.jsonl.tmp"
        await asyncio.to_thread(tmp.write_bytes, data)
        os.replace(tmp, self.files_dir / f"{file_id}.jsonl")
        _write_json(self.files_dir / f"{file_id}.json", meta)
        self.files[file_id] = meta
        return meta

    def list_files(self, purpose: str | None = None, after: str | None = None, limit: int = 10000) -> dict:
        files = [f for f in self.files.values() if purpose is None or f["purpose"] == purpose]
        return _page(sorted(files, key=lambda f: f["created_at"], reverse=True), after, limit)

    def get_file(self, file_id: str) -> dict:
        if file_id not in self.files:
            raise JobError(404, f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return self.files[file_id]

    def _examples(self, file_id: str, param: str):
        if file_id not in self.files:
            raise JobError(400, f"{param}: no file with id {file_id!r}", param=param, code="file_not_found")
        records = parse_jsonl((self.files_dir / f"{file_id}.jsonl").read_bytes())
        try:
            return tokenize_records(records, self.engine.tokenizer, self.engine.max_model_len)
        except ValueError as e:
            raise JobError(400, f"{param} {file_id}: {e}", param=param, code="invalid_file") from None

    # -- jobs --------------------------------------------------------------------------------------------
    async def create_job(self, req: dict) -> dict:
        """req: the validated request body (routes.CreateJobRequest as a dict). Checks everything that can be
        checked now, so a bad request fails here with a 4xx rather than later as a failed job."""
        if req["model"] != self.engine.model_name:
            raise JobError(404, f"model {req['model']!r} cannot be fine-tuned here; the served base model is "
                                f"{self.engine.model_name!r}", param="model", code="model_not_found")
        if req.get("integrations"):
            raise JobError(400, "integrations are not supported", param="integrations")
        if req.get("suffix") is not None and not _SUFFIX.fullmatch(req["suffix"]):
            raise JobError(400, "suffix must be 1-40 characters of letters, digits, '-' and '_'", param="suffix")
        hp = self._hyperparameters(req)
        extra = req.get("extra") or {}
        kind = extra.get("type") or "lora"
        if kind == "full":
            lora_options = [k for k in ("lora_rank", "lora_alpha") if extra.get(k) is not None]
            if lora_options:
                raise JobError(400, f"extra.{lora_options[0]} conflicts with extra.type 'full'", param="extra")
            n_params = sum(p.numel() for p in self.model.parameters())
            if n_params > MAX_FULL_FINETUNE_PARAMS:
                raise JobError(400, f"full fine-tuning is limited to models of at most {MAX_FULL_FINETUNE_PARAMS:,} "
                                    f"parameters (this one has {n_params:,}); use LoRA", param="extra")
        try:
            lora = LoRAConfig(rank=extra.get("lora_rank") or 8, alpha=extra.get("lora_alpha") or 16.0,
                              targets=extra.get("target_modules") or TARGETS, full=kind == "full")
        except ValueError as e:
            raise JobError(400, f"extra: {e}", param="extra") from None
        examples = await asyncio.to_thread(self._examples, req["training_file"], "training_file")
        if req.get("validation_file"):
            await asyncio.to_thread(self._examples, req["validation_file"], "validation_file")
        batch_size = hp["batch_size"] if hp["batch_size"] != "auto" else min(4, len(examples))
        accum = extra.get("gradient_accumulation_steps") or 1
        if batch_size % accum:
            raise JobError(400, f"hyperparameters.batch_size ({batch_size}) is not a multiple of "
                                f"extra.gradient_accumulation_steps ({accum})", param="extra")
        if batch_size > len(examples):
            raise JobError(400, f"hyperparameters.batch_size ({batch_size}) is larger than the training file "
                                f"({len(examples)} examples)", param="hyperparameters")
        job_id = f"ftjob-{uuid.uuid4().hex[:24]}"
        name = f"{self.engine.model_name}:ft-{req['suffix'] + '-' if req.get('suffix') else ''}{job_id[6:14]}"
        seed = req["seed"] if req.get("seed") is not None else random.randrange(1 << 31)
        hyperparameters = {"n_epochs": hp["n_epochs"] if hp["n_epochs"] != "auto" else 3, "batch_size": batch_size,
                           "learning_rate_multiplier": hp["learning_rate_multiplier"]
                           if hp["learning_rate_multiplier"] != "auto" else 1.0}
        job = {
            "id": job_id, "object": "fine_tuning.job", "created_at": int(time.time()), "error": None,
            "fine_tuned_model": None, "finished_at": None, "hyperparameters": hyperparameters,
            "model": req["model"], "organization_id": "org-local", "result_files": [], "seed": seed,
            "status": "queued", "trained_tokens": None, "training_file": req["training_file"],
            "validation_file": req.get("validation_file"), "estimated_finish": None, "integrations": [],
            "metadata": req.get("metadata"), "user_provided_suffix": req.get("suffix"),
            "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
            "extra": {"type": kind, "lora_rank": None if lora.full else lora.rank,
                      "lora_alpha": None if lora.full else lora.alpha, "target_modules": list(lora.targets),
                      "max_steps": extra.get("max_steps"), "gradient_accumulation_steps": accum,
                      "warmup_steps": extra.get("warmup_steps") or 0, "served_name": name},
        }
        (self.jobs_dir / job_id).mkdir()
        self.jobs[job_id] = job
        self._save(job)
        self._event(job, f"Created fine-tuning job {job_id}")
        self._update_job_gauge()
        self._queue.put_nowait(job_id)
        return job

    def _hyperparameters(self, req: dict) -> dict:
        top = req.get("hyperparameters") or {}
        method = req.get("method") or {}
        if method and method.get("type") != "supervised":
            raise JobError(400, f"method.type {method.get('type')!r} is not supported; use 'supervised'",
                           param="method.type")
        nested = (method.get("supervised") or {}).get("hyperparameters") or {}
        merged = {}
        for key in ("n_epochs", "batch_size", "learning_rate_multiplier"):
            a, b = top.get(key), nested.get(key)
            if a is not None and b is not None and a != b:
                raise JobError(400, f"hyperparameters.{key} ({a}) conflicts with method.supervised.hyperparameters."
                                    f"{key} ({b})", param=f"hyperparameters.{key}")
            merged[key] = a if a is not None else b if b is not None else "auto"
        return merged

    def list_jobs(self, after: str | None = None, limit: int = 20) -> dict:
        return _page(sorted(self.jobs.values(), key=lambda j: j["created_at"], reverse=True), after, limit)

    def get_job(self, job_id: str) -> dict:
        if job_id not in self.jobs:
            raise JobError(404, f"no fine-tuning job with id {job_id!r}", param="fine_tuning_job_id",
                           code="job_not_found")
        return self.jobs[job_id]

    def cancel_job(self, job_id: str) -> dict:
        job = self.get_job(job_id)
        if job["status"] in FINISHED:
            raise JobError(400, f"job {job_id} has already {job['status']}", param="fine_tuning_job_id")
        self._cancelled.add(job_id)  # a running job stops before its next micro-batch
        self._finish(job, "cancelled")
        return job

    def list_events(self, job_id: str, after: str | None = None, limit: int = 20) -> dict:
        self.get_job(job_id)
        path = self.jobs_dir / job_id / "events.jsonl"
        events = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                events.append(json.loads(line))
            except ValueError:  # a line cut short by a crash
                continue
        return _page(events[::-1], after, limit)

    # -- state -------------------------------------------------------------------------------------------
    def _save(self, job: dict) -> None:
        _write_json(self.jobs_dir / job["id"] / "job.json", job)

    def _event(self, job: dict, message: str, level: str = "info", data: dict | None = None) -> None:
        event = {"id": f"ftevent-{uuid.uuid4().hex[:24]}", "object": "fine_tuning.job.event",
                 "created_at": int(time.time()), "level": level, "message": message, "data": data or {},
                 "type": "metrics" if data else "message"}
        with open(self.jobs_dir / job["id"] / "events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")

    def _finish(self, job: dict, status: str, error: tuple[str, str] | None = None) -> None:
        job["status"], job["finished_at"] = status, int(time.time())
        if error is not None:
            job["error"] = {"code": error[0], "message": error[1], "param": None}
        self._save(job)
        message = {"succeeded": f"The job has succeeded: {job['fine_tuned_model']} is being served",
                   "cancelled": "The job was cancelled"}.get(status, f"The job failed: {error and error[1]}")
        self._event(job, message, level="error" if status == "failed" else "info")
        self._update_job_gauge()

    def _update_job_gauge(self) -> None:
        if self.metrics is None:
            return
        counts = dict.fromkeys(("queued", "running", *FINISHED), 0)
        for job in self.jobs.values():
            counts[job["status"]] += 1
        self.metrics.set_finetune_jobs(counts)

    def _serve_adapter(self, job: dict) -> None:
        param = next(self.model.parameters())
        adapter = Adapter.load(self.jobs_dir / job["id"] / "adapter.safetensors", param.device, param.dtype)
        add_adapter(self.model, job["extra"]["served_name"], adapter)
        job["fine_tuned_model"] = job["extra"]["served_name"]

    # -- training ----------------------------------------------------------------------------------------
    async def _worker(self) -> None:
        while True:
            job = self.jobs[await self._queue.get()]
            if job["status"] in FINISHED:  # cancelled while queued
                continue
            try:
                await self._run(job)
            except asyncio.CancelledError:
                if job["status"] == "running":
                    self._finish(job, "failed", error=("interrupted", "the server shut down while the job ran"))
                raise
            except Exception as e:  # a failed job must never take the server down
                if job["status"] != "running":  # cancelled meanwhile
                    continue
                if isinstance(e, TrainingDiverged):
                    self._finish(job, "failed", error=("training_diverged", f"{e}; try a lower learning rate"))
                else:
                    log.exception("fine-tuning job %s failed", job["id"])
                    self._finish(job, "failed", error=("internal_error", f"{type(e).__name__}: {e}"))
            finally:
                if self.metrics is not None:
                    self.metrics.set_finetune_progress(0.0)

    async def _run(self, job: dict) -> None:
        job["status"] = "running"
        self._save(job)
        self._update_job_gauge()
        self._event(job, "Fine-tuning job started")
        extra, hp = job["extra"], job["hyperparameters"]
        train = await asyncio.to_thread(self._examples, job["training_file"], "training_file")
        valid = await asyncio.to_thread(self._examples, job["validation_file"], "validation_file") \
            if job["validation_file"] else None
        config = TrainConfig(learning_rate=BASE_LEARNING_RATE[extra["type"]] * hp["learning_rate_multiplier"],
                             batch_size=hp["batch_size"],
                             micro_batch_size=hp["batch_size"] // extra["gradient_accumulation_steps"],
                             n_epochs=hp["n_epochs"], max_steps=extra["max_steps"], seed=job["seed"],
                             warmup_steps=extra["warmup_steps"])
        lora = LoRAConfig(rank=extra["lora_rank"] or 8, alpha=extra["lora_alpha"] or 16.0,
                          targets=extra["target_modules"], full=extra["type"] == "full")
        trainer = await asyncio.to_thread(Trainer, self.model, train, config, lora)
        steps = trainer.micro_batches()
        trained_tokens = 0
        while True:
            if job["id"] in self._cancelled:
                return
            start = time.perf_counter()
            result = await asyncio.to_thread(next, steps, None)
            if result is None and trainer.done:
                break
            await self._yield_to_engine(time.perf_counter() - start)
            if isinstance(result, StepResult):
                trained_tokens += result.tokens
                tokens_per_s = result.tokens / max(result.seconds, 1e-9)
                job["trained_tokens"] = trained_tokens
                self._event(job, f"Step {result.step}/{result.total_steps}: training loss={result.loss:.4f}",
                            data={"step": result.step, "total_steps": result.total_steps,
                                  "train_loss": result.loss, "tokens_per_second": tokens_per_s,
                                  "progress": result.step / result.total_steps})
                if self.metrics is not None:
                    self.metrics.set_finetune_progress(tokens_per_s, result.loss)
        if job["id"] in self._cancelled:
            return
        if valid:
            loss = await asyncio.to_thread(trainer.evaluate, valid)
            self._event(job, f"Validation loss={loss:.4f}", data={"step": trainer.step, "valid_loss": loss})
        path = self.jobs_dir / job["id"] / "adapter.safetensors"
        await asyncio.to_thread(trainer.adapter.save, path, {"base_model": job["model"], "job": job["id"]})
        if job["id"] in self._cancelled:
            return
        param = next(self.model.parameters())
        add_adapter(self.model, extra["served_name"], trainer.adapter.to(param.device, param.dtype))
        job["fine_tuned_model"] = extra["served_name"]
        self._finish(job, "succeeded")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the training activations back to the serving side

    async def _yield_to_engine(self, seconds: float) -> None:
        if self.engine.num_running or self.engine.num_waiting:
            duty = self.settings.finetune_duty_cycle
            await asyncio.sleep(seconds * (1 - duty) / duty)
        else:
            await asyncio.sleep(0)
