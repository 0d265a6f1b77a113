"""`llm-serve` / `python -m service`: the launcher, the process an operator starts. It binds the HTTP port, starts
the engine core process (service.engine.core) and `api_server_count` HTTP front-end processes (service.api.server)
that share the port, and watches them:

- SIGTERM or SIGINT: the front-ends drain (running requests get 30 s), then the engine core stops; exit 0.
- The engine core dies: the front-ends fail its requests at once (error events, 500) and answer /health with 503;
  a moment later the launcher stops them and exits 1, for the orchestrator (Kubernetes, compose's restart policy)
  to start a fresh service. A front-end that dies ends the service the same way.

Processes are spawned (never forked: CUDA and threads do not survive a fork), named in ps/top (llm-engine-core,
llm-api-N), and get SIGTERM should the launcher itself die.
"""
import ctypes
import ctypes.util
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from service.config import Settings, default_api_server_count, load_settings, usable_cpus

log = logging.getLogger("service.launcher")
CORE_DEATH_GRACE = 2.0  # seconds the front-ends keep answering (errors, 503) after the core died
STOP_TIMEOUT = 60.0  # front-ends drain for 30 s; past this they are killed


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s",
                        force=True)


def _become(name: str, level: str) -> None:
    """First thing in a child: its name, death with the launcher, logging."""
    multiprocessing.current_process().name = name
    if sys.platform == "linux":
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: the name ps and top show
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: a front-end ends with the launcher
    configure_logging(level)


def engine_core_main(settings: Settings, address: str, lifeline) -> None:
    start = time.perf_counter()
    _become("llm-engine-core", settings.log_level)
    # Compiled kernels persist across restarts; set before torch and triton are imported.
    cache = Path(settings.compile_cache_dir).expanduser()
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    import torch

    from service.engine.core import EngineCore
    from service.engine.llm_engine import resolve_device

    if resolve_device(settings.device).type == "cpu":
        # The cores the front-ends do not need. Intra-op threads that must wait for a core busy elsewhere stall
        # every barrier of every small op (15 ms instead of 0.3 for a decode's attention, measured on 2 cores).
        count = settings.api_server_count or default_api_server_count()
        torch.set_num_threads(max(1, usable_cpus() - count - 1))
    log.info("engine core imports took %.1fs", time.perf_counter() - start)
    EngineCore(settings, address).run(lifeline)


def frontend_main(settings: Settings, address: str, sock: socket.socket, index: int) -> None:
    _become(f"llm-api-{index}", settings.log_level)
    # The tokenizer's library takes seconds to import: pay that while the engine core loads, not after it.
    import transformers  # noqa: F401

    from service.api.server import serve

    serve(settings, address, sock, f"api-{index}-{os.getpid()}")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(sys.argv[1:] if argv is None else argv)
    configure_logging(settings.log_level)
    workdir = Path(tempfile.mkdtemp(prefix="tritonserve-"))
    (workdir / "metrics").mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(workdir / "metrics")  # read by the children's prometheus_client
    address = f"ipc://{workdir / 'engine-core.sock'}"
    count = settings.api_server_count or default_api_server_count()
    sock = bind(settings.host, settings.port)
    log.info("serving http://%s:%d with %d front-end process(es)", settings.host, sock.getsockname()[1], count)

    spawn = multiprocessing.get_context("spawn")
    lifeline, keep_alive = spawn.Pipe(duplex=False)  # the core stops when keep_alive closes (or we die)
    core = spawn.Process(target=engine_core_main, args=(settings, address, lifeline), name="llm-engine-core")
    frontends = [spawn.Process(target=frontend_main, args=(settings, address, sock, i), name=f"llm-api-{i}")
                 for i in range(count)]
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)
        try:
            wake_w.send(b"x")
        except BlockingIOError:
            pass

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    exit_code = 0
    try:
        core.start()
        lifeline.close()
        for p in frontends:
            p.start()
        sock.close()  # the front-ends hold it
        while not stopping:
            multiprocessing.connection.wait([core.sentinel, *(p.sentinel for p in frontends), wake_r])
            dead = [p for p in (core, *frontends) if p.exitcode is not None]
            if dead and not stopping:
                for p in dead:
                    log.error("%s exited with code %s: stopping the service", p.name, p.exitcode)
                if core in dead:
                    time.sleep(CORE_DEATH_GRACE)
                exit_code = 1
                break
        if stopping:
            log.info("received %s: draining", signal.Signals(stopping[0]).name)
    finally:
        _stop(frontends, STOP_TIMEOUT)
        keep_alive.close()
        _stop([core], STOP_TIMEOUT, terminate=False)
        shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(exit_code)


def _stop(processes: list, timeout: float, terminate: bool = True) -> None:
    """SIGTERM (unless they were asked otherwise), then SIGKILL for any still alive after timeout seconds."""
    for p in processes:
        if terminate and p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in processes:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            log.error("%s did not stop in %.0f s: killing it", p.name, timeout)
            p.kill()
            p.join()
