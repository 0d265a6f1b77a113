"""HTTP load for benchmarks/serve.py: closed-loop clients or Poisson arrivals, spread over worker processes.

Each worker process runs one asyncio loop with aiohttp, streams its requests (TGI /generate_stream or OpenAI
/v1/chat/completions with stream=true) and stamps every token event with time.monotonic(). On Linux that is
CLOCK_MONOTONIC, one clock for every process, so the parent merges all records into one timeline.

A level runs in three phases from a common start t0: warm-up (requests run, nothing is measured), the
measuring window, and a drain in which no new request starts and those in flight may finish (up to a cut-off,
after which they are cancelled and counted as cut). Throughput counts the token events that arrived inside the
window, whichever request they belong to. Latencies and goodput are over the requests that started inside the
window, followed through the drain: TTFT percentiles over requests, ITL percentiles over all their inter-token
gaps (cut requests count with the tokens they got), goodput over those that completed.

sequential_ttft: one client's requests one after another, over a new connection each or over one kept alive.
"""
import asyncio
import http.client
import json
import multiprocessing
import random
import time
import urllib.parse
from dataclasses import dataclass, field

import aiohttp
import numpy as np

TGI = "/generate_stream"
CHAT = "/v1/chat/completions"
ERROR_BACKOFF_S = 0.1  # a closed-loop client pauses after a failure: a server refusing at once is not flooded


@dataclass
class Workload:
    """What every request of a level asks for."""
    base_url: str
    endpoint: str  # TGI or CHAT
    words: list[str]  # prompts are random draws from these, so no two prompts share a cached prefix
    prompt_words: int
    new_tokens: int
    ignore_eos: bool  # the server extension that makes every request generate exactly new_tokens
    model: str | None = None  # the OpenAI `model` field
    adapters: tuple[str, ...] = ()  # LoRA adapters a request may name
    adapter_share: float = 0.0  # the chance that a request names one (drawn at random), else the base model

    def body(self, prompt: str, adapter: str | None = None) -> dict:
        # Greedy on both endpoints, as the offline reference (TGI is greedy by default).
        extension = {"ignore_eos": True} if self.ignore_eos else {}
        if self.endpoint == TGI:
            named = {"adapter_id": adapter} if adapter else {}
            return {"inputs": prompt, "parameters": {"max_new_tokens": self.new_tokens, **extension, **named}}
        return {"model": adapter or self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **extension}

    def adapter(self, rng: random.Random) -> str | None:
        """The adapter the next request names, or None."""
        return rng.choice(self.adapters) if self.adapters and rng.random() < self.adapter_share else None


@dataclass
class Record:
    """One request as its client saw it; times in time.monotonic() seconds."""
    start: float  # when it was due: closed loop, when its client sent it; open loop, its scheduled arrival
    sent: float = 0.0
    tokens: list[float] = field(default_factory=list)  # arrival of each token event
    ok: bool = False
    error: str | None = None  # neither ok nor error: still running at the cut-off, cancelled
    adapter: str | None = None  # the LoRA adapter it named


@dataclass
class Level:
    """A finished level: all records of all workers, the measuring window and each worker's CPU use."""
    records: list[Record]
    window: tuple[float, float]
    cpu_util: list[float]  # per worker process: CPU seconds / wall seconds over the level


class StreamError(Exception):
    pass


def _parse(endpoint: str, data: bytes) -> tuple[bool, bool, int | None]:
    """(a token arrived, the stream is complete, the server's count of generated tokens where this event gives
    it) for one SSE data payload."""
    if data == b"[DONE]":
        return False, True, None
    event = json.loads(data)
    if "error" in event:
        raise StreamError(f"error event: {event['error']}")
    if endpoint == TGI:  # one event per token, the last one carries generated_text and details
        final = event.get("generated_text") is not None
        return "token" in event, final, (event.get("details") or {}).get("generated_tokens") if final else None
    # A chunk counts as a token when it has content; the usage chunk before [DONE] has the count.
    choices = event.get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content")), False, (event.get("usage") or {}).get("completion_tokens")


async def _send(session: aiohttp.ClientSession, workload: Workload, prompt: str, rec: Record):
    rec.sent = time.monotonic()
    try:
        body = workload.body(prompt, rec.adapter)
        async with session.post(workload.base_url + workload.endpoint, json=body) as response:
            if response.status != 200:
                rec.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            complete, generated = False, None
            async for line in response.content:
                if line.startswith(b"data:"):
                    now = time.monotonic()
                    token, complete, count = _parse(workload.endpoint, line[5:].strip())
                    if token:
                        rec.tokens.append(now)
                    generated = generated if count is None else count
                    if complete:
                        break
        # The server's count where it gives one: a token may carry no text of its own (a special token, or part
        # of a character that the next token completes), and then no chat chunk.
        generated = len(rec.tokens) if generated is None else generated
        if not complete:
            rec.error = "stream ended without its final event"
        elif workload.ignore_eos and generated < workload.new_tokens:
            rec.error = f"{generated} tokens of {workload.new_tokens}"
        else:
            rec.ok = True
    except (aiohttp.ClientError, ValueError, StreamError) as e:  # ValueError: a malformed event
        rec.error = repr(e)


def _prompt(workload: Workload, rng: random.Random) -> str:
    return " ".join(rng.choices(workload.words, k=workload.prompt_words))


async def _closed_loop(session, workload: Workload, clients: int, rng, stop: float, records: list):
    async def client():
        while time.monotonic() < stop:
            rec = Record(start=time.monotonic(), adapter=workload.adapter(rng))
            records.append(rec)
            await _send(session, workload, _prompt(workload, rng), rec)
            if rec.error:
                await asyncio.sleep(ERROR_BACKOFF_S)

    await asyncio.gather(*(client() for _ in range(clients)))


async def _open_loop(session, workload: Workload, rate: float, rng, t0: float, stop: float, records: list):
    tasks, due = [], t0
    while (due := due + rng.expovariate(rate)) < stop:
        await asyncio.sleep(due - time.monotonic())
        # latency counts from the scheduled arrival, so a late sender cannot hide it
        rec = Record(start=due, adapter=workload.adapter(rng))
        records.append(rec)
        tasks.append(asyncio.create_task(_send(session, workload, _prompt(workload, rng), rec)))
    await asyncio.gather(*tasks)


@dataclass
class _WorkerSpec:
    workload: Workload
    clients: int  # closed loop: concurrent clients of this worker; 0 for open loop
    rate: float  # open loop: this worker's share of the arrival rate
    seed: int
    warmup: float
    seconds: float
    drain: float


async def _run(spec: _WorkerSpec, t0: float, records: list):
    rng = random.Random(spec.seed)
    stop = t0 + spec.warmup + spec.seconds
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        if spec.clients:
            load = _closed_loop(session, spec.workload, spec.clients, rng, stop, records)
        else:
            load = _open_loop(session, spec.workload, spec.rate, rng, t0, stop, records)
        try:
            await asyncio.wait_for(load, stop + spec.drain - time.monotonic())
        except TimeoutError:
            pass  # cancelled in flight: those records stay neither ok nor failed


def _worker(index: int, spec: _WorkerSpec, ready, go, t0, results):
    ready.put(index)
    go.wait()
    wall, cpu = time.monotonic(), time.process_time()
    records = []
    asyncio.run(_run(spec, t0.value, records))
    results.put((index, records, (time.process_time() - cpu) / (time.monotonic() - wall)))


def run_level(workload: Workload, *, concurrency: int = 0, rate: float = 0.0, processes: int, warmup: float,
              seconds: float, drain: float, seed: int = 0) -> Level:
    """One level: `concurrency` closed-loop clients, or Poisson arrivals at `rate` requests/s, split evenly over
    `processes` worker processes (spawned, so they share nothing with the caller)."""
    processes = max(1, min(processes, concurrency) if concurrency else processes)
    ctx = multiprocessing.get_context("spawn")
    ready, results, go, t0 = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    workers = []
    for i in range(processes):
        clients = concurrency // processes + (i < concurrency % processes) if concurrency else 0
        spec = _WorkerSpec(workload, clients, rate / processes, seed * 1000 + i, warmup, seconds, drain)
        workers.append(ctx.Process(target=_worker, args=(i, spec, ready, go, t0, results), daemon=True))
        workers[-1].start()
    for _ in workers:  # every worker has imported its modules: start them all at one instant
        ready.get(timeout=120)
    t0.value = time.monotonic() + 0.05
    go.set()
    outcomes = sorted(results.get(timeout=warmup + seconds + drain + 120) for _ in workers)
    for w in workers:
        w.join(timeout=30)
    start = t0.value + warmup
    return Level([r for _, records, _ in outcomes for r in records], (start, start + seconds),
                 [util for _, _, util in outcomes])


def _ms(values, q: float) -> float | None:
    return 1e3 * float(np.percentile(values, q)) if len(values) else None


def summarize(level: Level, ttft_slo_s: float = 0.5, itl_slo_s: float = 0.05) -> dict:
    """Throughput, latency percentiles, counts and goodput (requests/s that met TTFT <= ttft_slo_s and their own
    ITL p99 <= itl_slo_s) of a level, by the rules in this module's docstring."""
    w0, w1 = level.window
    span = w1 - w0
    measured = [r for r in level.records if w0 <= r.start < w1]
    # Latencies also from requests cut off at the end: their tokens until then are real observations, and a
    # server too slow to finish requests within the drain would otherwise have none.
    timed = [r for r in measured if r.tokens and r.error is None]
    ttft = [r.tokens[0] - r.start for r in timed]
    gaps = [np.diff(r.tokens) for r in timed]
    good = sum(r.ok and t <= ttft_slo_s and (len(g) == 0 or np.percentile(g, 99) <= itl_slo_s)
               for r, t, g in zip(timed, ttft, gaps))
    errors = [r.error for r in level.records if r.error]
    all_gaps = np.concatenate(gaps) if gaps else []
    return {
        "tok_per_s": sum(w0 <= t < w1 for r in level.records for t in r.tokens) / span,
        "ttft_p50_ms": _ms(ttft, 50), "ttft_p99_ms": _ms(ttft, 99),
        "itl_p50_ms": _ms(all_gaps, 50), "itl_p99_ms": _ms(all_gaps, 99),
        "requests": len(measured), "errors": len(errors),
        "cut": sum(not r.ok and r.error is None for r in measured),
        "achieved_rps": len(measured) / span, "goodput_rps": good / span,
        "send_lag_p99_ms": _ms([r.sent - r.start for r in measured if r.sent], 99),
        "first_error": errors[0] if errors else None,
        "loadgen_processes": len(level.cpu_util), "loadgen_cpu_util": [round(u, 3) for u in level.cpu_util],
    }



def sequential_ttft(workload: Workload, prompts: list[str], fresh: bool) -> list[float]:
    """TTFT (s) of each prompt, sent one after another by one client, the standard library's http.client (its
    headers and body in two writes, TCP_NODELAY unset: as many clients): over a new connection per request,
    connecting included (fresh, as curl and many callers do), or all over one kept-alive connection."""
    url = urllib.parse.urlsplit(workload.base_url)
    conn, times = None, []
    for prompt in prompts:
        conn = conn or http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        start = time.monotonic()
        body = json.dumps(workload.body(prompt)).encode()
        conn.request("POST", workload.endpoint, body, {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise StreamError(f"HTTP {response.status}: {response.read()[:200]!r}")
        first = complete = None
        for line in response:
            if line.startswith(b"data:"):
                token, complete, _ = _parse(workload.endpoint, line[5:].strip())
                first = first or (time.monotonic() if token else None)
                if complete:
                    break
        if not (first and complete):
            raise StreamError("the stream ended without a token or without its final event")
        response.read()  # the end of the chunked body: the connection is ready for the next request
        times.append(first - start)
        if fresh:
            conn.close()
            conn = None
    if conn is not None:
        conn.close()
    return times
