"""The Prometheus series of the service (the Grafana dashboards in docker/grafana query these names).

Each process writes the series it knows: the HTTP front-ends time requests (FrontendMetrics), each engine core
reports steps, queues, the KV cache, GPU memory and fine-tuning (EngineMetrics), every series labelled with the
core's index (`engine="0"`, `"1"`, ... with data parallelism; "0" alone without): dashboards sum or max over it.
The launcher sets PROMETHEUS_MULTIPROC_DIR, so prometheus_client keeps every process's values in files there and
any front-end's /metrics adds them up (counters and histograms summed; a core's gauges taken from that live core,
kept apart from the other cores' by their label). Without it (one process: tests, notebooks) the series live in
the registry passed in.
"""
import os
import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                   2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0)
TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(16))  # 1 .. 32768
ENDPOINTS = ("generate", "generate_stream", "completions", "chat_completions")
OUTCOMES = ("success", "validation_error", "aborted", "overloaded", "internal_error")
FINETUNE_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
CORE_GAUGE_MODE = "livemostrecent"  # one writer per `engine` label (that core); dropped when it dies


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def exposition(registry: CollectorRegistry) -> bytes:
    """The /metrics text: every process's series in multiprocess mode, else the given registry's."""
    if multiprocess():
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    return generate_latest(registry)


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """histogram.observe(v) for every v, with one increment per bucket touched rather than a call per value:
    the per-token latencies of a whole engine step at once. It adds to the same per-bucket values (non-cumulative,
    +Inf last) and sum that Histogram.observe does; tests/test_observability.py checks that it stays so."""
    if not values:
        return
    counts = np.bincount(np.searchsorted(histogram._upper_bounds, values, side="left"),
                         minlength=len(histogram._buckets))
    histogram._sum.inc(sum(values))  # the builtin: numpy would first copy the list into an array
    for bucket, count in zip(histogram._buckets, counts.tolist()):
        if count:
            bucket.inc(count)


class FrontendMetrics:
    """Request-level series, written by each HTTP front-end."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.time_to_first_token = Histogram("llm_time_to_first_token_seconds", "Arrival to first generated token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("llm_inter_token_latency_seconds", "Gap between consecutive tokens",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("llm_e2e_request_latency_seconds", "Arrival to last token, finished requests",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("llm_queue_time_seconds", "Arrival until the step that made the first token",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("llm_request_prompt_tokens", "Prompt tokens per request",
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("llm_request_generation_tokens", "Generated tokens per request",
                                                   buckets=TOKEN_BUCKETS, registry=r)
        self.requests = Counter("llm_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        for endpoint in ENDPOINTS:
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "Generated tokens", registry=r)

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()


class EngineMetrics:
    """Step, queue, KV-cache, memory and fine-tuning series, written by engine core `engine_index`."""

    def __init__(self, registry: CollectorRegistry, engine_index: int = 0):
        r = registry
        self.engine = str(engine_index)

        def histogram(name, doc):
            return Histogram(name, doc, ["engine"], buckets=LATENCY_BUCKETS, registry=r).labels(self.engine)

        def counter(name, doc):
            return Counter(name, doc, ["engine"], registry=r).labels(self.engine)

        def gauge(name, doc):
            return Gauge(name, doc, ["engine"], registry=r, multiprocess_mode=CORE_GAUGE_MODE).labels(self.engine)

        self.step_time = histogram("llm_engine_step_seconds", "Duration of one engine step")
        self.preemptions = counter("llm_preemptions", "Sequences preempted by the scheduler")
        self.prefix_queried = counter("llm_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("llm_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache")
        self.running = gauge("llm_requests_running", "Sequences being generated")
        self.waiting = gauge("llm_requests_waiting", "Requests waiting for admission")
        self.kv_usage = gauge("llm_kv_cache_usage_ratio", "Fraction of KV cache blocks in use")
        self.batch_size = gauge("llm_batch_size", "Sequences in the last engine step")
        self.gpu_allocated = gauge("llm_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated")
        self.gpu_reserved = gauge("llm_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved")
        self.gpu_total = gauge("llm_gpu_memory_total_bytes", "Total memory of the GPU")
        self.finetune_jobs = Gauge("llm_finetune_jobs", "Fine-tuning jobs by state", ["engine", "state"], registry=r,
                                   multiprocess_mode=CORE_GAUGE_MODE)
        self.set_finetune_jobs({})
        self.finetune_tokens_per_second = gauge("llm_finetune_tokens_per_second", "Training throughput of the "
                                                "running job")
        self.finetune_loss = gauge("llm_finetune_loss", "Last training loss")
        for g in (self.running, self.waiting, self.kv_usage, self.batch_size, self.gpu_allocated, self.gpu_reserved,
                  self.gpu_total, self.finetune_tokens_per_second, self.finetune_loss):
            g.set(0)  # in multiprocess mode a gauge is exported once written

    def record_step(self, stats) -> None:
        """After every engine step (a service.engine.llm_engine.StepStats)."""
        self.step_time.observe(stats.step_seconds)
        self.batch_size.set(stats.batch_size)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_queried.inc(stats.prefix_queried_tokens)
        self.prefix_hits.inc(stats.prefix_hit_tokens)

    def record_load(self, running: int, waiting: int, kv_usage: float) -> None:
        """The present: after steps, and when requests come and go while no step runs."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        if running == 0:
            self.batch_size.set(0)

    def record_gpu_memory(self, allocated: int, reserved: int, total: int) -> None:
        self.gpu_allocated.set(allocated)
        self.gpu_reserved.set(reserved)
        self.gpu_total.set(total)

    def set_finetune_jobs(self, counts: dict[str, int]) -> None:
        """Number of jobs in each state; states missing from counts are 0."""
        unknown = set(counts) - set(FINETUNE_STATES)
        if unknown:
            raise ValueError(f"unknown fine-tuning states {sorted(unknown)}; known: {FINETUNE_STATES}")
        for state in FINETUNE_STATES:
            self.finetune_jobs.labels(self.engine, state).set(counts.get(state, 0))

    def set_finetune_progress(self, tokens_per_second: float, loss: float | None = None) -> None:
        self.finetune_tokens_per_second.set(tokens_per_second)
        if loss is not None:
            self.finetune_loss.set(loss)


class RequestTimer:
    """Request-level latencies and token counts of one request, as its tokens arrive (several per call when the
    front-end's event loop fell behind: the later ones arrived at the same moment)."""

    def __init__(self, metrics: FrontendMetrics, endpoint: str, prompt_tokens: int):
        self.metrics = metrics
        self.endpoint = endpoint
        self.prompt_tokens = prompt_tokens
        self.arrival = time.perf_counter()
        self.last_token: float | None = None
        self.generated_tokens = 0

    def on_tokens(self, now: float, count: int, gaps: list[float], queue_seconds: float | None = None) -> None:
        """Observes time to first token at once and appends the inter-token gaps to `gaps`, which the caller
        observes for many requests in one go (observe_many)."""
        if self.last_token is None:
            self.metrics.time_to_first_token.observe(now - self.arrival)
            if queue_seconds is not None:
                self.metrics.queue_time.observe(queue_seconds)
        elif now != self.last_token:  # the request's other completions (n > 1) deliver in the same instant
            gaps.append(now - self.last_token)
        gaps.extend([0.0] * (count - 1))
        self.last_token = now
        self.generated_tokens += count

    def finish(self, outcome: str) -> None:
        """Counts the request once, with its outcome; only finished requests have an end-to-end latency."""
        m = self.metrics
        if outcome == "success":
            m.e2e_latency.observe(time.perf_counter() - self.arrival)
        m.request_prompt_tokens.observe(self.prompt_tokens)
        m.request_generation_tokens.observe(self.generated_tokens)
        m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(self.generated_tokens)
        m.count_request(self.endpoint, outcome)
