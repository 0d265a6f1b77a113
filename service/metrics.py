"""The Prometheus series of the service (the Grafana dashboards in docker/grafana query these names).

One Metrics object per app holds its own CollectorRegistry. The engine feeds it StepStats after every step;
the HTTP layer times each request with a RequestTimer; gauges that describe the present (queue, KV cache,
GPU memory) are refreshed when /metrics is scraped.
"""
import time
from collections.abc import Mapping

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from service.engine.outputs import StepStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                   2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0)
TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(16))  # 1 .. 32768
ENDPOINTS = ("generate", "generate_stream", "completions", "chat_completions")
OUTCOMES = ("success", "validation_error", "aborted", "overloaded", "internal_error")
FINETUNE_STATES = ("queued", "running", "succeeded", "failed", "cancelled")


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.time_to_first_token = Histogram("llm_time_to_first_token_seconds", "Arrival to first generated token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("llm_inter_token_latency_seconds", "Gap between consecutive tokens",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("llm_e2e_request_latency_seconds", "Arrival to last token, finished requests",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("llm_queue_time_seconds", "Arrival until the step that made the first token",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("llm_engine_step_seconds", "Duration of one engine step",
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
        self.preemptions = Counter("llm_preemptions", "Sequences preempted by the scheduler", registry=r)
        self.prefix_queried = Counter("llm_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("llm_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                   registry=r)

        self.running = Gauge("llm_requests_running", "Sequences being generated", registry=r)
        self.waiting = Gauge("llm_requests_waiting", "Requests waiting for admission", registry=r)
        self.kv_usage = Gauge("llm_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", registry=r)
        self.batch_size = Gauge("llm_batch_size", "Sequences in the last engine step", registry=r)
        self.gpu_allocated = Gauge("llm_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated", registry=r)
        self.gpu_reserved = Gauge("llm_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved", registry=r)
        self.gpu_total = Gauge("llm_gpu_memory_total_bytes", "Total memory of the GPU", registry=r)

        self.finetune_jobs = Gauge("llm_finetune_jobs", "Fine-tuning jobs by state", ["state"], registry=r)
        self.set_finetune_jobs({})
        self.finetune_tokens_per_second = Gauge("llm_finetune_tokens_per_second", "Training throughput of the "
                                                "running job", registry=r)
        self.finetune_loss = Gauge("llm_finetune_loss", "Last training loss", registry=r)

    def record_step(self, stats: StepStats) -> None:
        """Engine step listener."""
        self.step_time.observe(stats.step_seconds)
        self.batch_size.set(stats.batch_size)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_queried.inc(stats.prefix_queried_tokens)
        self.prefix_hits.inc(stats.prefix_hit_tokens)

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def render(self, engine=None) -> bytes:
        """The exposition text; refreshes the gauges of the present first (no step runs while idle)."""
        if engine is not None:
            self.running.set(engine.num_running)
            self.waiting.set(engine.num_waiting)
            self.kv_usage.set(engine.kv_usage)
            if engine.num_running == 0:
                self.batch_size.set(0)
        if torch.cuda.is_available():
            self.gpu_allocated.set(torch.cuda.memory_allocated())
            self.gpu_reserved.set(torch.cuda.memory_reserved())
            self.gpu_total.set(torch.cuda.mem_get_info()[1])
        return generate_latest(self.registry)

    # The fine-tuning job manager reports through these two.
    def set_finetune_jobs(self, counts: Mapping[str, int]) -> None:
        """Number of jobs in each state; states missing from counts are 0."""
        unknown = set(counts) - set(FINETUNE_STATES)
        if unknown:
            raise ValueError(f"unknown fine-tuning states {sorted(unknown)}; known: {FINETUNE_STATES}")
        for state in FINETUNE_STATES:
            self.finetune_jobs.labels(state).set(counts.get(state, 0))

    def set_finetune_progress(self, tokens_per_second: float, loss: float | None = None) -> None:
        self.finetune_tokens_per_second.set(tokens_per_second)
        if loss is not None:
            self.finetune_loss.set(loss)


class RequestTimer:
    """Request-level latencies and token counts of one request, observed as its tokens arrive."""

    def __init__(self, metrics: Metrics, endpoint: str, prompt_tokens: int):
        self.metrics = metrics
        self.endpoint = endpoint
        self.prompt_tokens = prompt_tokens
        self.arrival = time.perf_counter()
        self.last_token: float | None = None
        self.generated_tokens = 0

    def on_token(self, queue_seconds: float | None = None) -> None:
        """queue_seconds: the engine's wait before first scheduling, reported with the first token."""
        now = time.perf_counter()
        m = self.metrics
        if self.last_token is None:
            m.time_to_first_token.observe(now - self.arrival)
            if queue_seconds is not None:
                m.queue_time.observe(queue_seconds)
        else:
            m.inter_token_latency.observe(now - self.last_token)
        self.last_token = now
        self.generated_tokens += 1

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
