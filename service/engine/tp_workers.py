"""Tensor-parallel workers: ranks 1..N-1 of a model sharded over `tensor_parallel_size` ranks, each in its own
process (llm-tp-worker-K) spawned by the engine core, which is rank 0 (service.model.parallel says what each rank
holds).

Rank 0 schedules and samples; every rank runs every step's forward pass. Each step, rank 0's runner sends its
plan (service.engine.model_runner.StepPlan: which graph, and the inputs packed on the host) to each worker over a
ZeroMQ PUSH socket, as a small msgpack header plus the numpy arrays' raw bytes (no pickle); the workers run it
with ModelRunner.execute, whose collectives meet rank 0's. A plan also carries the LoRA adapters rank 0 began or
stopped serving since the last one: a worker reads their files on a thread of its own while steps run, and waits
for a read only in a step that uses its adapter (ModelRunner._apply_adapter_changes). Start-up runs the same
sequence on every rank (load the slices, size the KV cache from the rank's own memory and keep the smallest, warm
up, capture CUDA graphs).

A worker that dies leaves rank 0's collectives waiting forever: a watchdog thread in the engine core ends the
core at once, which its launcher handles like any core death (requests fail, /health 503, exit 1). A worker ends
with rank 0: its lifeline pipe closes.
"""
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import zmq

from service.config import Settings
from service.engine.model_runner import StepPlan, start_runner
from service.model.loader import load_model
from service.model.parallel import TensorParallel

log = logging.getLogger(__name__)
_ARRAYS = "arrays"
_FIELDS = [f.name for f in dataclasses.fields(StepPlan) if f.name != _ARRAYS]


def encode_plan(plan: StepPlan) -> list:
    """ZeroMQ frames of a plan: a msgpack header (its fields, and each array's dtype and shape), then the arrays."""
    arrays = [np.ascontiguousarray(a) for a in plan.arrays]
    header = [getattr(plan, name) for name in _FIELDS] + [[(a.dtype.str, a.shape) for a in arrays]]
    return [msgspec.msgpack.encode(header), *arrays]


def decode_plan(frames: list) -> StepPlan:
    *values, shapes = msgspec.msgpack.decode(frames[0])
    plan = StepPlan(**dict(zip(_FIELDS, values)))
    plan.key = tuple(plan.key)
    plan.copies = [tuple(c) for c in plan.copies]
    plan.arrays = [np.frombuffer(frame, dtype=dtype).reshape(shape).copy()
                   for frame, (dtype, shape) in zip(frames[1:], shapes)]
    return plan


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Workers:
    """Rank 0's handle on the other ranks: spawns them, joins their process group, sends them each step's plan."""

    def __init__(self, settings: Settings, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 max_model_len: int):
        size = settings.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")
        self._dir = tempfile.mkdtemp(prefix="tritonserve-tp-")
        self.context = zmq.Context()
        self.sockets = []
        spawn = multiprocessing.get_context("spawn")
        lifeline, self._keep_alive = spawn.Pipe(duplex=False)
        init = f"file://{self._dir}/rendezvous"  # the ranks meet in a file: no port to pick and lose to a race
        self.processes = []
        for rank in range(1, size):
            address = f"ipc://{self._dir}/rank-{rank}.sock"
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            self.sockets.append(sock)
            args = (settings, str(model_dir), dtype, str(device), max_model_len, rank, size, init, address, lifeline,
                    torch.get_num_threads())
            self.processes.append(spawn.Process(target=worker_main, args=args, name=f"llm-tp-worker-{rank}"))
        for p in self.processes:
            p.start()
        lifeline.close()
        log.info("tensor parallelism: %d ranks over %s, workers %s", size, _backend(device),
                 [p.pid for p in self.processes])
        # Watched from now on: a worker that fails to start would leave the group's rendezvous waiting forever.
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        dist.init_process_group(_backend(device), init_method=init, rank=0, world_size=size,
                                device_id=torch.device("cuda", device.index or 0) if device.type == "cuda" else None)

    def _watch(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.processes])
        if self._keep_alive.closed:  # close() stopped them
            return
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self.processes if p.exitcode is not None]
        log.critical("tensor-parallel worker %s died: the model is incomplete; ending this engine core", dead)
        shutil.rmtree(self._dir, ignore_errors=True)
        logging.shutdown()
        os._exit(1)

    def send(self, plan: StepPlan) -> None:
        frames = encode_plan(plan)
        for sock in self.sockets:
            sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        """Stops the workers (their lifeline closes) and leaves the process group."""
        self._keep_alive.close()
        for p in self.processes:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for sock in self.sockets:
            sock.close()
        self.context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(settings: Settings, model_dir: str, dtype: torch.dtype, device: str, max_model_len: int, rank: int,
                size: int, init: str, address: str, lifeline, threads: int) -> None:
    from service.launcher import become

    # Like the core, a worker outlives a signal to the whole process group (Ctrl-C) while the front-ends drain: it
    # ends with rank 0 (its lifeline closes), or is killed with it, should it be waiting in a collective then.
    become(f"llm-tp-worker-{rank}", settings.log_level, death_signal=signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads)
    dist.init_process_group(_backend(device), init_method=init, rank=rank, world_size=size,
                            device_id=device if device.type == "cuda" else None)
    tp = TensorParallel.current()
    runner = start_runner(load_model(model_dir, dtype, device, tp), settings, max_model_len)
    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(lifeline.fileno(), zmq.POLLIN)
    log.info("rank %d of %d ready", rank, size)
    try:
        while True:
            events = dict(poller.poll())
            if lifeline.fileno() in events:
                break
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                runner.execute(decode_plan(frames), None)
    finally:
        sock.close()
        context.term()
        dist.destroy_process_group()
