"""Real servers for tests.

`with serve(**settings) as base_url:` starts the service as an operator does (`python -m service`, the launcher
with its engine-core and front-end processes) on a free loopback port, with the embedded default model on the CPU
unless told otherwise, waits until GET /health answers 200, and stops it with SIGTERM (its drain included) on exit.
`service_process(...)` yields the running Service (url, launcher process, log) for tests that look at processes.

`with serve_in_process(**settings) as (base_url, core):` runs the engine core in a thread of the test process and
one front-end on uvicorn in another, so a test can reach into the core (fault injection). Use either from a
module-scoped fixture where possible: a start takes a few seconds.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 300  # a cold GPU start (Triton compiles, autotuning, CUDA graphs) takes about 100 s
DEFAULTS = {"device": "cpu", "cuda_graphs": False, "log_level": "warning"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 4000) -> str:
        """The log's last n characters, without the reference-leak report Triton's bindings print at exit (60-odd
        lines that pushed a failure's traceback out of the tail)."""
        if not self.log.exists():
            return "(no log)"
        lines = self.log.read_text(errors="replace").splitlines(keepends=True)
        noise = ("nanobind:", " - leaked ", " - ... skipped remainder", "See https://nanobind")
        return "".join(line for line in lines if not line.startswith(noise))[-n:]


def settings_env(settings: dict) -> dict[str, str]:
    """LLM_* variables for settings fields (booleans as true/false)."""
    return {f"LLM_{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items()
            if v is not None}


def wait_healthy(url: str, alive, timeout: float = START_TIMEOUT, describe=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not alive():
            raise RuntimeError(f"the server exited before it was healthy:\n{describe()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health never answered 200:\n{describe()}")
        time.sleep(0.1)


def launch_command(tmp: Path, **settings) -> tuple[list[str], dict[str, str], int]:
    """The launcher's command line, environment (these Settings fields over the tests' defaults, fine-tuning under
    tmp) and free port."""
    settings = {**DEFAULTS, "finetune_dir": str(tmp / "finetune"), **settings}
    port = free_port()
    argv = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port)]
    return argv, {**os.environ, **settings_env(settings)}, port


@contextmanager
def service_process(**settings) -> Iterator[Service]:
    tmp = Path(tempfile.mkdtemp(prefix="llm-serve-test-"))
    argv, env, port = launch_command(tmp, **settings)
    log = tmp / "service.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=_die_with_parent)
    service = Service(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_healthy(service.url, lambda: process.poll() is None, describe=service.log_tail)
        yield service
    finally:
        stop_process(process)
        print(f"--- the service's log ({log}):\n{service.log_tail()}")  # pytest shows it when a test failed
        shutil.rmtree(tmp, ignore_errors=True)


def _die_with_parent() -> None:
    """In the launcher before it runs: SIGTERM (its drain) should pytest itself be killed, so that no service
    outlives the run holding the GPU."""
    import ctypes
    import ctypes.util
    ctypes.CDLL(ctypes.util.find_library("c")).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def stop_process(process: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to the launcher (which drains and stops its children), then SIGKILL to the whole group."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@contextmanager
def serve(**settings) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT) of a running service with these Settings fields."""
    with service_process(**settings) as service:
        yield service.url


@contextmanager
def serve_in_process(**settings):
    """Yields (base URL, EngineCore): the core runs in a thread here, one front-end on uvicorn in another."""
    from prometheus_client import CollectorRegistry

    from service.api import create_app
    from service.config import Settings
    from service.engine.core import EngineCore

    tmp = Path(tempfile.mkdtemp(prefix="llm-serve-test-"))
    settings = Settings(**{**DEFAULTS, "finetune_dir": str(tmp / "finetune"), **settings})
    address = f"ipc://{tmp / 'core.sock'}"
    registry = CollectorRegistry()
    core = EngineCore(settings, address, registry)
    core_thread = threading.Thread(target=core.run, name="engine-core", daemon=True)
    core_thread.start()
    app = create_app(settings, address, "api-test", registry)
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
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        wait_healthy(url, thread.is_alive)
        yield url, core
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        core.stop()
        core_thread.join(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


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
