"""A real uvicorn server for tests: `with serve(**settings) as base_url: ...`.

It runs create_app(Settings(...)) in a background thread on an ephemeral loopback port (the embedded default
model on the CPU unless told otherwise), waits until GET /health answers 200, and shuts it down gracefully
(engine drain included) on exit. Fine-tuning files go to a fresh temporary directory unless finetune_dir is given. Use it from a module-scoped fixture: loading the model takes a few seconds.
"""
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from service.api import create_app
from service.config import Settings

START_TIMEOUT = 300  # a cold GPU start (Triton compiles, autotuning, CUDA graphs) takes about 100 s


@contextmanager
def serve(engine=None, **settings) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT) of a running server with these Settings fields (serving
    `engine`, an AsyncEngine, when given; else one loaded from the settings)."""
    finetune_dir = tempfile.mkdtemp(prefix="llm-serve-test-")
    settings = Settings(**{"device": "cpu", "cuda_graphs": False, "finetune_dir": finetune_dir, **settings})
    app = create_app(settings, engine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=10))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start (see the log above)")
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        base_url = f"http://127.0.0.1:{port}"
        while httpx.get(f"{base_url}/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base_url}/health never answered 200")
            time.sleep(0.05)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        shutil.rmtree(finetune_dir, ignore_errors=True)


def scrape(base_url: str, headers: dict | None = None) -> dict[tuple, float]:
    """GET /metrics as {(sample name, ((label, value), ...)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{base_url}/metrics", headers=headers)
    response.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The data payloads of a server-sent event stream."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()
