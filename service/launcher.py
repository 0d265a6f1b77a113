"""`llm-serve` / `python -m service`: the launcher, the process an operator starts. It binds the HTTP port, starts
`data_parallel_size` engine core processes (service.engine.core; usually one), each with its own address and
GPU(s), and `api_server_count` HTTP front-end processes (service.api.server) that share the port and each talk to
every core, and watches them:

- SIGTERM or SIGINT: the front-ends drain (running requests get 30 s), then the engine cores stop; exit 0.
- An engine core dies: the front-ends fail its requests at once (error events, 500) and answer /health with 503;
  a moment later the launcher stops them (the other cores' requests get the drain) and exits 1, for the
  orchestrator (Kubernetes, compose's restart policy) to start a fresh service. A front-end that dies ends the
  service the same way.

Processes are spawned (never forked: CUDA and threads do not survive a fork), named in ps/top (llm-engine-core, or
llm-core-K with several; llm-api-N), and get SIGTERM should the launcher itself die.
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
STOP_TIMEOUT = 60.0  # seconds an engine core has to stop; past this it is killed
STOP_MARGIN = 30.0  # seconds a front-end has beyond drain_seconds (server.SHUTDOWN_GRACE, exit) before a kill


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s",
                        force=True)


def become(name: str, level: str, ps_name: str | None = None, death_signal: int = signal.SIGTERM) -> None:
    """First thing in a child: its name (ps_name in ps and top, when the name is too long for them), death with its
    parent (by death_signal), logging."""
    multiprocessing.current_process().name = name
    if sys.platform == "linux":
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(15, (ps_name or name).encode()[:15], 0, 0, 0)  # PR_SET_NAME: the name ps and top show
        libc.prctl(1, death_signal, 0, 0, 0)  # PR_SET_PDEATHSIG: a front-end ends with the launcher
    configure_logging(level)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, found without torch (the launcher never imports it): CUDA_VISIBLE_DEVICES
    when set, else one per GPU the NVIDIA driver lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [device for device in visible.split(",") if device.strip()]
    driver = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(driver.iterdir())))] if driver.is_dir() else []


def core_gpus(settings: Settings) -> list[str | None]:
    """Each engine core's CUDA_VISIBLE_DEVICES: core K gets GPUs [K*tp, (K+1)*tp) of those visible, tp being
    tensor_parallel_size (its rank r then runs on cuda:r). None leaves the environment as it is: with one core, on
    the CPU, and where at most one GPU is visible (the cores then share it, each taking its
    gpu_memory_utilization of it: lower that)."""
    count, tp = settings.data_parallel_size, settings.tensor_parallel_size
    gpus = visible_gpus()
    if count == 1 or settings.device == "cpu" or len(gpus) <= 1:
        return [None] * count
    if len(gpus) < count * tp:
        sys.exit(f"data_parallel_size {count} x tensor_parallel_size {tp} needs {count * tp} GPUs; "
                 f"{len(gpus)} are visible")
    return [",".join(gpus[k * tp:(k + 1) * tp]) for k in range(count)]


def engine_core_main(settings: Settings, address: str, lifeline, index: int = 0, gpus: str | None = None) -> None:
    start = time.perf_counter()
    if settings.data_parallel_size == 1:
        become("llm-engine-core", settings.log_level)
    else:  # the kernel keeps 15 characters of a name for ps and top
        become(f"llm-engine-core-{index}", settings.log_level, ps_name=f"llm-core-{index}")
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus  # before torch is imported (CUDA reads it when it starts)
    # Compiled kernels persist across restarts; set before torch and triton are imported.
    cache = Path(settings.compile_cache_dir).expanduser()
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    import torch

    from service.engine.core import EngineCore
    from service.engine.llm_engine import resolve_device

    if resolve_device(settings.device).type == "cpu":
        # The CPUs the front-ends do not need, shared by the engine cores. Intra-op threads that must wait for a CPU
        # busy elsewhere stall every barrier of every small op (15 ms instead of 0.3 for a decode's attention,
        # measured on 2 CPUs).
        count = settings.api_server_count or default_api_server_count()
        torch.set_num_threads(max(1, (usable_cpus() - count - 1) // settings.data_parallel_size))
    log.info("engine core imports took %.1fs", time.perf_counter() - start)
    EngineCore(settings, address, engine_index=index).run(lifeline)


def frontend_main(settings: Settings, addresses: list[str], sock: socket.socket, index: int) -> None:
    become(f"llm-api-{index}", settings.log_level)
    # The tokenizer's library takes seconds to import: pay that while the engine core loads, not after it.
    import transformers  # noqa: F401

    from service.api.server import serve

    serve(settings, addresses, sock, f"api-{index}-{os.getpid()}")


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
    gpus = core_gpus(settings)
    workdir = Path(tempfile.mkdtemp(prefix="tritonserve-"))
    (workdir / "metrics").mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(workdir / "metrics")  # read by the children's prometheus_client
    dp = settings.data_parallel_size
    addresses = [f"ipc://{workdir / f'engine-core-{k}.sock'}" for k in range(dp)]
    count = settings.api_server_count or default_api_server_count()
    sock = bind(settings.host, settings.port)
    log.info("serving http://%s:%d with %d front-end process(es) and %d engine core(s)", settings.host,
             sock.getsockname()[1], count, dp)

    spawn = multiprocessing.get_context("spawn")
    lifelines = [spawn.Pipe(duplex=False) for _ in range(dp)]  # a core stops when its write end closes (or we die)
    cores = [spawn.Process(target=engine_core_main, args=(settings, addresses[k], lifelines[k][0], k, gpus[k]),
                           name="llm-engine-core" if dp == 1 else f"llm-engine-core-{k}") for k in range(dp)]
    frontends = [spawn.Process(target=frontend_main, args=(settings, addresses, sock, i), name=f"llm-api-{i}")
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
        for core, (lifeline, _) in zip(cores, lifelines):
            core.start()
            lifeline.close()
        for p in frontends:
            p.start()
        sock.close()  # the front-ends hold it
        while not stopping:
            multiprocessing.connection.wait([*(p.sentinel for p in (*cores, *frontends)), wake_r])
            dead = [p for p in (*cores, *frontends) if p.exitcode is not None]
            if dead and not stopping:
                for p in dead:
                    log.error("%s exited with code %s: stopping the service", p.name, p.exitcode)
                if any(core in dead for core in cores):
                    time.sleep(CORE_DEATH_GRACE)
                exit_code = 1
                break
        if stopping:
            log.info("received %s: draining", signal.Signals(stopping[0]).name)
    finally:
        _stop(frontends, settings.drain_seconds + STOP_MARGIN)
        for _, keep_alive in lifelines:
            keep_alive.close()
        _stop(cores, STOP_TIMEOUT, terminate=False)
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
