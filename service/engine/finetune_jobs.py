"""Fine-tuning files and jobs, owned by the engine core and kept on disk under settings.finetune_dir, so a
restarted server lists them and serves their adapters again:

    files/<file-id>.jsonl, files/<file-id>.json          uploaded data and its metadata
    files/<file-id>.examples                            its tokenized examples (service.finetune.data)
    jobs/<job-id>/job.json                              the job (the OpenAI fine_tuning.job object + ours)
    jobs/<job-id>/events.jsonl                          its events, oldest first
    jobs/<job-id>/adapter.safetensors                   the trained adapter (written atomically)

The front-ends do the heavy lifting off the core's loop (upload parsing, tokenization) and call in here for the
metadata, so every front-end sees one state. Jobs run one at a time on the engine's model and device, one
micro-batch per call of train_step() from the core's loop, between engine steps: while requests are being served
a job takes at most `finetune_duty_cycle` of the time (by default half: a pause as long as the micro-batch just
done), and when the engine is idle it runs back to back. A finished job's adapter is served at once, loaded as
POST /v1/load_lora_adapter loads one (LLMEngine.load_adapter), by every engine core: core 0 alone runs the jobs, and
the other cores of data parallelism load the adapters of finished jobs at start (finished_adapters) and a new one
when a front-end tells them (service.protocol.AdaptersChanged.published).

An adapter serves only the base model it was trained on. Its file records that model's fingerprint (architecture,
shapes, a hash of sampled weights: service.model.fingerprint), and a server started on a directory that holds the
jobs of another base model (two servers sharing ./finetune-data, say) neither serves nor lists their adapters;
their records stay as they are, for the server they belong to.
"""
import json
import logging
import math
import os
import random
import re
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from service.engine.llm_engine import AdapterError
from service.finetune.data import load_examples
from service.finetune.trainer import StepResult, TrainConfig, Trainer, TrainingDiverged
from service.model.lora import TARGETS, LoRAConfig

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

    def as_dict(self) -> dict:
        return {"status": self.status, "message": self.message, "param": self.param, "code": self.code}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def adapter_path(jobs_dir: Path, job_id: str) -> Path:
    """Where a job's trained adapter is written."""
    return jobs_dir / job_id / "adapter.safetensors"


def finished_adapters(finetune_dir) -> dict[str, str]:
    """{served name: adapter file} of the jobs that succeeded, oldest first, from their records."""
    jobs_dir = Path(finetune_dir, "jobs")
    jobs = [json.loads(p.read_text()) for p in jobs_dir.glob("*/job.json")]
    return {j["extra"]["served_name"]: str(adapter_path(jobs_dir, j["id"]))
            for j in sorted(jobs, key=lambda j: j["created_at"]) if j["status"] == "succeeded"}


def _page(items: list[dict], after: str | None, limit: int) -> dict:
    """An OpenAI cursor page of items (already newest first): those after the item with id `after`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    data = items[:limit]
    return {"object": "list", "data": data, "has_more": len(items) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@dataclass
class _Run:
    """The job being trained."""
    job: dict
    trainer: Trainer
    steps: object  # the trainer's micro-batch generator
    valid_file: str | None
    trained_tokens: int = 0
    losses: list[float] = field(default_factory=list)  # of each optimizer step
    not_before: float = 0.0  # perf_counter time before which the next micro-batch must wait (duty cycle)


class JobManager:
    # What the front-ends may call (service.protocol.Call.method).
    CALLS = ("register_file", "list_files", "get_file", "delete_file", "create_job", "list_jobs", "get_job",
             "cancel_job", "list_events")

    def __init__(self, settings, model, model_name: str, metrics=None, *, base: dict,
                 serve_adapter: Callable[[str, str], None]):
        """base: the model's fingerprint (service.model.fingerprint), which the adapters of its jobs record.
        serve_adapter(name, path): serves a finished job's adapter file as model `name`, as POST
        /v1/load_lora_adapter does (LLMEngine.load_adapter: AdapterError if it cannot)."""
        self.settings, self.model, self.model_name, self.metrics = settings, model, model_name, metrics
        self.serve_adapter = serve_adapter
        self.root = Path(settings.finetune_dir)
        self.files_dir, self.jobs_dir = self.root / "files", self.root / "jobs"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.files = {p.stem: json.loads(p.read_text()) for p in sorted(self.files_dir.glob("*.json"))}
        self.jobs = {p.parent.name: json.loads(p.read_text()) for p in sorted(self.jobs_dir.glob("*/job.json"))}
        self.queue: deque[str] = deque()
        self.run: _Run | None = None
        self.base = base
        self.unserved: dict[str, str] = {}  # job id -> why its adapter is not served: made for another base model
        for job in sorted(self.jobs.values(), key=lambda j: j["created_at"]):
            if job["status"] == "succeeded":
                try:
                    self.serve_adapter(job["extra"]["served_name"], str(self._adapter_path(job)))
                except AdapterError as e:
                    if e.code not in ("adapter_mismatch", "adapter_exists"):
                        log.error("cannot serve the adapter of %s: %s", job["id"], e)
                        self._finish(job, "failed", error=("adapter_unavailable", f"the adapter cannot be loaded: {e}"))
                        continue
                    # not a failure: the job did succeed, on another server's model (or --lora-modules took its name)
                    log.warning("not serving the adapter of fine-tuning job %s (a fine-tune of %r; this server "
                                "serves %r): %s", job["id"], job["model"], self.model_name, e)
                    self.unserved[job["id"]] = f"not served here: {e}"
                except Exception as e:  # a damaged adapter must not keep the server from starting
                    log.exception("cannot serve the adapter of %s", job["id"])
                    self._finish(job, "failed", error=("adapter_unavailable", f"the adapter cannot be loaded: {e}"))
            elif job["status"] == "running":
                self._finish(job, "failed", error=("interrupted", "the server restarted while the job was running"))
            elif job["status"] == "queued":
                self.queue.append(job["id"])
        self._update_job_gauge()

    # -- files (the front-end validated and wrote the data) ----------------------------------------------
    def register_file(self, meta: dict) -> dict:
        limit = self.settings.finetune_max_files
        if len(self.files) >= limit:
            raise JobError(400, f"the server keeps at most {limit} files; delete some (DELETE /v1/files/{{id}})",
                           param="file", code="limit_reached")
        _write_json(self.files_dir / f"{meta['id']}.json", meta)
        self.files[meta["id"]] = meta
        return meta

    def delete_file(self, file_id: str) -> dict:
        self.get_file(file_id)
        users = [j["id"] for j in self.jobs.values() if j["status"] in ("queued", "running")
                 and file_id in (j["training_file"], j["validation_file"])]
        if users:
            raise JobError(409, f"file {file_id} is in use by job {users[0]}, which has not finished",
                           param="file_id", code="file_in_use")
        for suffix in (".json", ".jsonl", ".examples"):
            try:
                os.remove(self.files_dir / f"{file_id}{suffix}")
            except FileNotFoundError:
                pass
        del self.files[file_id]
        return {"id": file_id, "object": "file", "deleted": True}

    def list_files(self, purpose: str | None = None, after: str | None = None, limit: int = 10000) -> dict:
        files = [f for f in self.files.values() if purpose is None or f["purpose"] == purpose]
        return _page(sorted(files, key=lambda f: f["created_at"], reverse=True), after, limit)

    def get_file(self, file_id: str, param: str = "file_id") -> dict:
        if file_id not in self.files:
            status, code = (404, "file_not_found") if param == "file_id" else (400, "file_not_found")
            raise JobError(status, f"{'' if param == 'file_id' else param + ': '}no file with id {file_id!r}",
                           param=param, code=code)
        return self.files[file_id]

    # -- jobs --------------------------------------------------------------------------------------------
    def create_job(self, body: dict, num_examples: int) -> dict:
        """body: the validated request (routes' CreateJobRequest as a dict), whose files the front-end has
        tokenized (num_examples in the training file). Checks everything that can be checked now, so a bad
        request fails here with a 4xx rather than later as a failed job."""
        req = body
        if self.settings.tensor_parallel_size > 1:
            # The trainer runs on one device; a sharded model would need the backward's collectives too.
            raise JobError(400, "fine-tuning needs tensor_parallel_size 1 (this server shards the model over "
                                f"{self.settings.tensor_parallel_size} ranks); adapters trained elsewhere are served",
                           code="unsupported")
        if len(self.jobs) >= self.settings.finetune_max_jobs:
            raise JobError(400, f"the server keeps at most {self.settings.finetune_max_jobs} fine-tuning jobs",
                           code="limit_reached")
        if req["model"] != self.model_name:
            raise JobError(404, f"model {req['model']!r} cannot be fine-tuned here; the served base model is "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        if req.get("integrations"):
            raise JobError(400, "integrations are not supported", param="integrations")
        if req.get("suffix") is not None and not _SUFFIX.fullmatch(req["suffix"]):
            raise JobError(400, "suffix must be 1-40 characters of letters, digits, '-' and '_'", param="suffix")
        for param in ("training_file", "validation_file"):
            if req.get(param):
                self.get_file(req[param], param)
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
        batch_size = hp["batch_size"] if hp["batch_size"] != "auto" else min(4, num_examples)
        accum = extra.get("gradient_accumulation_steps") or 1
        if batch_size % accum:
            raise JobError(400, f"hyperparameters.batch_size ({batch_size}) is not a multiple of "
                                f"extra.gradient_accumulation_steps ({accum})", param="extra")
        if batch_size > num_examples:
            raise JobError(400, f"hyperparameters.batch_size ({batch_size}) is larger than the training file "
                                f"({num_examples} examples)", param="hyperparameters")
        job_id = f"ftjob-{uuid.uuid4().hex[:24]}"
        name = f"{self.model_name}:ft-{req['suffix'] + '-' if req.get('suffix') else ''}{job_id[6:14]}"
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
        self.queue.append(job_id)
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
        jobs = sorted(self.jobs.values(), key=lambda j: j["created_at"], reverse=True)
        return _page([self._view(j) for j in jobs], after, limit)

    def get_job(self, job_id: str) -> dict:
        return self._view(self._job(job_id))

    def _job(self, job_id: str) -> dict:
        if job_id not in self.jobs:
            raise JobError(404, f"no fine-tuning job with id {job_id!r}", param="fine_tuning_job_id",
                           code="job_not_found")
        return self.jobs[job_id]

    def _view(self, job: dict) -> dict:
        """The job as the API shows it: one whose adapter this server does not serve says why in
        extra.not_served (never written to its record, which belongs to the server of its base model)."""
        if job["id"] not in self.unserved:
            return job
        return {**job, "extra": {**job["extra"], "not_served": self.unserved[job["id"]]}}

    def cancel_job(self, job_id: str) -> dict:
        job = self._job(job_id)
        if job["status"] in FINISHED:
            raise JobError(400, f"job {job_id} has already {job['status']}", param="fine_tuning_job_id")
        self._finish(job, "cancelled")  # a running job stops before its next micro-batch
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

    # -- training, driven by the core's loop ----------------------------------------------------------------
    def seconds_until_work(self, now: float) -> float | None:
        """When train_step() has work: 0 for now, a delay while the duty cycle holds training back, None when
        no job waits or runs."""
        if self.run is not None:
            return max(0.0, self.run.not_before - now)
        return 0.0 if self.queue else None

    def train_step(self, engine_busy: bool) -> None:
        """One micro-batch of the running job (starting the next queued one first if none runs)."""
        if self.run is None:
            self._start_next()
            return
        run, job = self.run, self.run.job
        if job["status"] != "running":  # cancelled meanwhile
            self._end_run()
            return
        start = time.perf_counter()
        try:
            result = next(run.steps, None)
            if result is None and run.trainer.done:
                self._succeed(run)
                return
        except Exception as e:  # a failed job must never take the server down
            if isinstance(e, TrainingDiverged):
                self._finish(job, "failed", error=("training_diverged", f"{e}; try a lower learning rate"))
            else:
                log.exception("fine-tuning job %s failed", job["id"])
                self._finish(job, "failed", error=("internal_error", f"{type(e).__name__}: {e}"))
            self._end_run()
            return
        now = time.perf_counter()
        duty = self.settings.finetune_duty_cycle
        run.not_before = now + (now - start) * (1 - duty) / duty if engine_busy else now
        if isinstance(result, StepResult):
            run.losses.append(result.loss)
            run.trained_tokens += result.tokens
            tokens_per_s = result.tokens / max(result.seconds, 1e-9)
            job["trained_tokens"] = run.trained_tokens
            self._event(job, f"Step {result.step}/{result.total_steps}: training loss={result.loss:.4f}",
                        data={"step": result.step, "total_steps": result.total_steps, "train_loss": result.loss,
                              "tokens_per_second": tokens_per_s, "progress": result.step / result.total_steps})
            if self.metrics is not None:
                self.metrics.set_finetune_progress(tokens_per_s, result.loss)

    def _start_next(self) -> None:
        while self.queue:
            job = self.jobs[self.queue.popleft()]
            if job["status"] != "queued":  # cancelled while queued
                continue
            job["status"] = "running"
            self._save(job)
            self._update_job_gauge()
            self._event(job, "Fine-tuning job started")
            extra, hp = job["extra"], job["hyperparameters"]
            try:
                examples = load_examples(self.files_dir, job["training_file"])
                config = TrainConfig(learning_rate=BASE_LEARNING_RATE[extra["type"]] * hp["learning_rate_multiplier"],
                                     batch_size=hp["batch_size"],
                                     micro_batch_size=hp["batch_size"] // extra["gradient_accumulation_steps"],
                                     n_epochs=hp["n_epochs"], max_steps=extra["max_steps"], seed=job["seed"],
                                     warmup_steps=extra["warmup_steps"])
                lora = LoRAConfig(rank=extra["lora_rank"] or 8, alpha=extra["lora_alpha"] or 16.0,
                                  targets=extra["target_modules"], full=extra["type"] == "full")
                trainer = Trainer(self.model, examples, config, lora)
            except Exception as e:
                log.exception("fine-tuning job %s could not start", job["id"])
                self._finish(job, "failed", error=("internal_error", f"{type(e).__name__}: {e}"))
                continue
            self.run = _Run(job, trainer, trainer.micro_batches(), job["validation_file"])
            return

    def _succeed(self, run: _Run) -> None:
        job = run.job
        first, last = (run.losses[0], run.losses[-1]) if run.losses else (0.0, 0.0)
        if not math.isfinite(last) or (len(run.losses) > 1 and last >= first):
            # Its adapter would serve a model no better than the base (a learning rate too high flattens it).
            self._finish(job, "failed", error=("training_diverged", f"the training loss went from {first:.4f} to "
                                               f"{last:.4f}; try a lower learning rate"))
            self._end_run()
            return
        if run.valid_file:
            loss = run.trainer.evaluate(load_examples(self.files_dir, run.valid_file))
            self._event(job, f"Validation loss={loss:.4f}", data={"step": run.trainer.step, "valid_loss": loss})
        path = self._adapter_path(job)
        run.trainer.adapter.save(path, {"base_model": job["model"], "job": job["id"]}, base=self.base)
        self._end_run()
        try:
            self.serve_adapter(job["extra"]["served_name"], str(path))
        except AdapterError as e:  # its name was taken meanwhile (POST /v1/load_lora_adapter), say
            self._finish(job, "failed", error=("adapter_unavailable", f"the adapter cannot be served: {e}"))
            return
        job["fine_tuned_model"] = job["extra"]["served_name"]
        self._finish(job, "succeeded")

    def _end_run(self) -> None:
        self.run = None
        if self.metrics is not None:
            self.metrics.set_finetune_progress(0.0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the training activations back to the serving side

    def shutdown(self) -> None:
        if self.run is not None and self.run.job["status"] == "running":
            self._finish(self.run.job, "failed", error=("interrupted", "the server shut down while the job ran"))
        self.run = None

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

    def _adapter_path(self, job: dict) -> Path:
        return adapter_path(self.jobs_dir, job["id"])
