"""A front-end's training-data work, done in a worker process of its own: checking an uploaded file and tokenizing
one for a job take seconds for big files (a 32 MiB upload, a long chat rendered once per assistant turn), and in
the front-end's process they would hold the interpreter (the GIL) that its event loop needs to serve requests."""
import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from service.finetune.data import parse_jsonl, save_examples, tokenize_records
from service.text import load_tokenizer

_tokenizer = None  # in the worker process


def _load(model_dir: str) -> None:
    global _tokenizer
    _tokenizer = load_tokenizer(model_dir)


def _check(path: Path, max_messages: int) -> None:
    parse_jsonl(path.read_bytes(), max_messages)


def _tokenize(files_dir: Path, file_id: str, max_len: int, max_messages: int) -> int:
    records = parse_jsonl((files_dir / f"{file_id}.jsonl").read_bytes(), max_messages)
    examples = tokenize_records(records, _tokenizer, max_len)
    save_examples(files_dir, file_id, examples)
    return len(examples)


class TrainingDataWorker:
    """One worker process, started at first use (a front-end that never sees fine-tuning never starts one).
    ValueError from the data (a bad line, an example too long) comes back as it was raised."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.pool: ProcessPoolExecutor | None = None

    async def _run(self, fn, *args):
        if self.pool is None:
            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_load,
                                            initargs=(self.model_dir,))
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def check_upload(self, path: Path, max_messages: int) -> None:
        """Raises ValueError naming the first bad line of the file at path."""
        await self._run(_check, path, max_messages)

    async def tokenize_file(self, files_dir: Path, file_id: str, max_len: int, max_messages: int) -> int:
        """Tokenizes a stored training file and saves its examples beside it (for the engine core); their
        number."""
        return await self._run(_tokenize, files_dir, file_id, max_len, max_messages)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def remove_quietly(*paths: Path) -> None:
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
