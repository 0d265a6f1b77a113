"""The Prometheus series of the service (the Grafana dashboards in docker/grafana query these names).

Each process writes the series it knows: the HTTP front-ends time requests (FrontendMetrics), each engine core
reports steps, queues, the KV cache, GPU memory and fine-tuning (EngineMetrics), every series labelled with the
core's index (`engine="0"`, `"1"`, ... with data parallelism; "0" alone without): dashboards sum or max over it.
The launcher sets PROMETHEUS_MULTIPROC_DIR, so prometheus_client keeps every process's values in files there and
any front-end's /metrics adds them up (counters and histograms summed; a core's gauges taken from that live core,
kept apart from the other cores' by their label). Without it (one process: tests, notebooks) the series live in
the registry passed in.

Beside our `llm_*` series, the model-server series under vLLM's names (`vllm:*`, vllm/v1/metrics/loggers.py),
which inference gateways (the Gateway API Inference Extension's endpoint picker), autoscalers and dashboards
written for vLLM read: the same names, types, label names, units and histogram buckets, each labelled
`model_name` (the served model) and `engine` (the core that served the request).
"""
import os
import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                   2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0)
TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(16))  # 1 .. 32768
ENDPOINTS = ("generate", "generate_stream", "completions", "chat_completions", "responses")
OUTCOMES = ("success", "validation_error", "aborted", "overloaded", "internal_error")
FINETUNE_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
# How the model runner ran a step (indexed by service.engine.model_runner's DECODE_GRAPH, PREFILL_GRAPH, EAGER), and
# whose LoRA adapters it served: none, from slots inside the graphs, or through the eager forward's hooks.
STEP_KINDS = ("decode_graph", "prefill_graph", "eager")
STEP_ADAPTERS = ("none", "slots", "hooks")
CORE_GAUGE_MODE = "livemostrecent"  # one writer per `engine` label (that core); dropped when it dies

# vLLM's buckets: a dashboard that sums `by (le)` over a fleet of vLLM and tritonserve replicas needs the same edges.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's 1, 2, 5, 10, 20, ... series stops at the model's context length; ours at 500k, past any context we serve.
VLLM_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5))
VLLM_LABELS = ["model_name", "engine"]
FINISHED_REASONS = ("stop", "length", "abort")  # vllm:request_success_total{finished_reason}
LORA_INFO = "vllm:lora_requests_info"


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def exposition(registry: CollectorRegistry) -> bytes:
    """The /metrics text: every process's series in multiprocess mode, else the given registry's."""
    if multiprocess():
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    return generate_latest(_WithoutRetiredLoraSets(registry))


class _WithoutRetiredLoraSets:
    """A registry's metrics less the label sets of vllm:lora_requests_info set to 0 (EngineMetrics.record_loras):
    the multiprocess files keep every label set ever written, and the gateway wants the current one."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for metric in self.registry.collect():
            if metric.name == LORA_INFO:
                metric.samples = [s for s in metric.samples if s.value]
            yield metric


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

        def histogram(name, doc, buckets):
            return Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=r)

        # vLLM's request series, by EngineRequestSeries attribute; labelled once a core's model is known (attach).
        self.vllm_families = {
            "time_to_first_token": histogram("vllm:time_to_first_token_seconds", "Arrival to first token",
                                             VLLM_TTFT_BUCKETS),
            "inter_token_latency": histogram("vllm:inter_token_latency_seconds", "Gap between consecutive tokens",
                                             VLLM_ITL_BUCKETS),
            "e2e_latency": histogram("vllm:e2e_request_latency_seconds", "Arrival to last token, finished requests",
                                     VLLM_REQUEST_BUCKETS),
            "queue_time": histogram("vllm:request_queue_time_seconds", "Arrival in the engine to first scheduled",
                                    VLLM_REQUEST_BUCKETS),
            "prefill_time": histogram("vllm:request_prefill_time_seconds", "Time to first token less the queue "
                                      "time, finished requests", VLLM_REQUEST_BUCKETS),
            "decode_time": histogram("vllm:request_decode_time_seconds", "First to last token, finished requests",
                                     VLLM_REQUEST_BUCKETS),
            "request_prompt_tokens": histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request",
                                               VLLM_TOKEN_BUCKETS),
            "request_generation_tokens": histogram("vllm:request_generation_tokens", "Generated tokens per finished "
                                                   "request", VLLM_TOKEN_BUCKETS),
            "max_generation_tokens": histogram("vllm:request_max_num_generation_tokens", "Most tokens generated by "
                                               "one completion of a finished request", VLLM_TOKEN_BUCKETS),
        }
        self.vllm_success = Counter("vllm:request_success", "Requests by how they ended: stop, length or abort",
                                    [*VLLM_LABELS, "finished_reason"], registry=r)
        self.engines: dict[int, EngineRequestSeries] = {}

    def attach(self, model_name: str, engine: int) -> None:
        """Creates engine core `engine`'s vLLM request series (all at 0) once the core has said which model it
        serves; the requests it runs record into them."""
        self.engines[engine] = EngineRequestSeries(self, model_name, str(engine))

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def observe_gaps(self, engine: int, gaps: list[float]) -> None:
        """The inter-token gaps of one step of engine core `engine`, for all of this front-end's requests there."""
        observe_many(self.inter_token_latency, gaps)
        observe_many(self.engines[engine].inter_token_latency, gaps)


class EngineRequestSeries:
    """vLLM's request series of one engine core: FrontendMetrics.vllm_families labelled with the core's model name
    and index, as attributes of the same names, and `success` by finished reason."""

    def __init__(self, metrics: FrontendMetrics, model_name: str, engine: str):
        for attribute, family in metrics.vllm_families.items():
            setattr(self, attribute, family.labels(model_name, engine))
        self.success = {reason: metrics.vllm_success.labels(model_name, engine, reason)
                        for reason in FINISHED_REASONS}


class EngineMetrics:
    """Step, queue, KV-cache, memory and fine-tuning series, ours and vLLM's, written by engine core `engine_index`,
    which serves `model_name` from a KV cache of `num_gpu_blocks` blocks of `block_size` tokens."""

    def __init__(self, registry: CollectorRegistry, engine_index: int, model_name: str, block_size: int,
                 num_gpu_blocks: int, num_speculative_tokens: int = 0):
        r = registry
        self.engine = str(engine_index)

        def histogram(name, doc):
            return Histogram(name, doc, ["engine"], buckets=LATENCY_BUCKETS, registry=r).labels(self.engine)

        def counter(name, doc):
            return Counter(name, doc, ["engine"], registry=r).labels(self.engine)

        def gauge(name, doc):
            return Gauge(name, doc, ["engine"], registry=r, multiprocess_mode=CORE_GAUGE_MODE).labels(self.engine)

        def vllm_counter(name, doc):
            return Counter(name, doc, VLLM_LABELS, registry=r).labels(model_name, self.engine)

        def vllm_gauge(name, doc):
            return Gauge(name, doc, VLLM_LABELS, registry=r, multiprocess_mode=CORE_GAUGE_MODE).labels(
                model_name, self.engine)

        self.step_time = histogram("llm_engine_step_seconds", "Duration of one engine step")
        by_kind = ["engine", "kind", "adapters"]
        self.steps = Counter("llm_engine_steps", "Engine steps by how the model runner ran them and whose LoRA "
                             "adapters they served", by_kind, registry=r)
        self.steps_seconds = Counter("llm_engine_step_time_seconds", "Duration of those engine steps, summed",
                                     by_kind, registry=r)
        # Every (kind, adapters) series exists from the start; record_step looks its pair up here, not by labels()
        self.steps_by_kind = {(kind, adapters): (self.steps.labels(self.engine, kind, adapters),
                                                 self.steps_seconds.labels(self.engine, kind, adapters))
                              for kind in STEP_KINDS for adapters in STEP_ADAPTERS}
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

        self.vllm_running = vllm_gauge("vllm:num_requests_running", "Sequences being generated")
        self.vllm_waiting = vllm_gauge("vllm:num_requests_waiting", "Requests waiting for admission")
        self.vllm_kv_usage = vllm_gauge("vllm:kv_cache_usage_perc", "Fraction (0-1) of KV cache blocks in use")
        self.vllm_preemptions = vllm_counter("vllm:num_preemptions", "Sequences preempted by the scheduler")
        self.vllm_prefix_queries = vllm_counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                                "cache")
        self.vllm_prefix_hits = vllm_counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.vllm_prompt_tokens = vllm_counter("vllm:prompt_tokens", "Prompt tokens of sequences that got their "
                                               "first token")
        self.vllm_generation_tokens = vllm_counter("vllm:generation_tokens", "Generated tokens")
        # An info series (value 1, the facts in its labels): the gateway's prefix-cache scorer sizes its index by it.
        Gauge("vllm:cache_config_info", "The KV cache's shape", ["engine", "block_size", "num_gpu_blocks"],
              registry=r, multiprocess_mode=CORE_GAUGE_MODE).labels(self.engine, str(block_size),
                                                                      str(num_gpu_blocks)).set(1)
        # Its value is a time, so the cores' equal label sets merge by max; a dead core's go with it.
        self.lora_info = Gauge(LORA_INFO, "Adapters of running and waiting requests (labels), when last seen",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r,
                               multiprocess_mode="livemax")
        self._lora_labels: tuple[str, str, str] | None = None
        self.adapter_reads = counter("llm_lora_adapter_reads", "LoRA adapter files read into memory")
        self.slot_loads = counter("llm_lora_slot_loads", "LoRA adapters copied into a slot on the device")
        self.slot_evictions = counter("llm_lora_slot_evictions", "Slot loads that replaced another adapter")
        self._lora_counts = (0, 0, 0)
        # Speculative decoding (only when it is on, as vLLM): totals from the engine, counted as they grow.
        self._spec = None
        if num_speculative_tokens:
            self.spec_drafts = vllm_counter("vllm:spec_decode_num_drafts", "Sequences verified with draft tokens")
            self.spec_draft_tokens = vllm_counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified")
            self.spec_accepted = vllm_counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their "
                              "place in the draft", VLLM_LABELS + ["position"], registry=r)
            self.spec_per_pos = [per_pos.labels(model_name, self.engine, str(i)) for i in range(num_speculative_tokens)]
            self.spec_proposer_failures = counter("llm_spec_decode_proposer_failures",
                                                  "Proposals that raised; their steps ran without drafts")
            self._spec = (0, 0, 0, [0] * num_speculative_tokens, 0)

        for g in (self.running, self.waiting, self.kv_usage, self.batch_size, self.gpu_allocated, self.gpu_reserved,
                  self.gpu_total, self.finetune_tokens_per_second, self.finetune_loss):
            g.set(0)  # in multiprocess mode a gauge is exported once written

    def record_lora_counts(self, reads: int, slot_loads: int, slot_evictions: int) -> None:
        """The engine's running counts of adapter reads, slot loads and slot evictions (the counters follow)."""
        counts = (reads, slot_loads, slot_evictions)
        for counter, now, before in zip((self.adapter_reads, self.slot_loads, self.slot_evictions), counts,
                                        self._lora_counts):
            if now > before:
                counter.inc(now - before)
        self._lora_counts = counts

    def record_spec(self, drafts: int, draft_tokens: int, accepted: int, per_position: list[int],
                    proposer_failures: int = 0) -> None:
        """The engine's running speculative-decoding totals (service.engine.speculative.SpecStats)."""
        before = self._spec
        for counter, now, then in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted,
                                       self.spec_proposer_failures),
                                      (drafts, draft_tokens, accepted, proposer_failures), before[:3] + before[4:]):
            if now > then:
                counter.inc(now - then)
        for counter, now, then in zip(self.spec_per_pos, per_position, before[3]):
            if now > then:
                counter.inc(now - then)
        self._spec = (drafts, draft_tokens, accepted, list(per_position), proposer_failures)

    def record_step(self, stats) -> None:
        """After every engine step (a service.engine.llm_engine.StepStats)."""
        self.step_time.observe(stats.step_seconds)
        steps, seconds = self.steps_by_kind[stats.kind, stats.adapters]
        steps.inc()
        seconds.inc(stats.step_seconds)
        self.batch_size.set(stats.batch_size)
        self.preemptions.inc(stats.num_preemptions)
        self.vllm_preemptions.inc(stats.num_preemptions)
        self.prefix_queried.inc(stats.prefix_queried_tokens)
        self.vllm_prefix_queries.inc(stats.prefix_queried_tokens)
        self.prefix_hits.inc(stats.prefix_hit_tokens)
        self.vllm_prefix_hits.inc(stats.prefix_hit_tokens)

    def record_outputs(self, outputs) -> None:
        """A step's outputs (service.protocol.RequestOutput): a generated token each, but for failures. A sequence's
        first token carries its prompt's length: vLLM counts prompt tokens then, once per sequence."""
        tokens = prompt_tokens = 0
        for out in outputs:
            if out.error is None:
                tokens += 1
                prompt_tokens += out.prompt_tokens
        self.vllm_generation_tokens.inc(tokens)
        self.vllm_prompt_tokens.inc(prompt_tokens)

    def record_load(self, running: int, waiting: int, kv_usage: float) -> None:
        """The present: after steps, and when requests come and go while no step runs."""
        self.running.set(running)
        self.vllm_running.set(running)
        self.waiting.set(waiting)
        self.vllm_waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.vllm_kv_usage.set(kv_usage)
        if running == 0:
            self.batch_size.set(0)

    def record_loras(self, running: list[str], waiting: list[str], max_lora: int) -> None:
        """The adapters that running and waiting requests use, for the gateway's LoRA affinity: one series whose
        labels name them (comma-separated, as vLLM's) and whose value is when they were last seen. A label set no
        longer current is set to 0, which /metrics leaves out (exposition)."""
        labels = (str(max_lora), ",".join(running), ",".join(waiting))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self.lora_info.labels(*self._lora_labels).set(0)
            self._lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

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
    front-end's event loop fell behind: the later ones arrived at the same moment). `engine`: the engine core that
    runs it (its first prompt's, when its prompts went to several), whose vLLM series it records into."""

    def __init__(self, metrics: FrontendMetrics, endpoint: str, prompt_tokens: int, engine: int):
        self.metrics = metrics
        self.vllm = metrics.engines[engine]
        self.endpoint = endpoint
        self.prompt_tokens = prompt_tokens
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.queue_seconds = 0.0
        self.generated_tokens = 0

    def on_tokens(self, now: float, count: int, gaps: list[float], queue_seconds: float | None = None) -> None:
        """Observes time to first token at once and appends the inter-token gaps to `gaps`, which the caller
        observes for many requests in one go (FrontendMetrics.observe_gaps)."""
        if self.last_token is None:
            self.first_token = now
            self.metrics.time_to_first_token.observe(now - self.arrival)
            self.vllm.time_to_first_token.observe(now - self.arrival)
            if queue_seconds is not None:
                self.queue_seconds = queue_seconds
                self.metrics.queue_time.observe(queue_seconds)
                self.vllm.queue_time.observe(queue_seconds)
        elif now != self.last_token:  # the request's other completions (n > 1) deliver in the same instant
            gaps.append(now - self.last_token)
        gaps.extend([0.0] * (count - 1))
        self.last_token = now
        self.generated_tokens += count

    def finish(self, outcome: str, completions: list) -> None:
        """Counts the request once, with its outcome; only finished requests have an end-to-end latency.
        completions: its streams (service.api.engine_client.RequestStream: finish_reason, count of tokens)."""
        m, v = self.metrics, self.vllm
        if outcome == "success":
            end = time.perf_counter()
            m.e2e_latency.observe(end - self.arrival)
            # vLLM's request series count finished requests only; one ended otherwise (its client left, the
            # engine failed it) is an abort.
            v.e2e_latency.observe(end - self.arrival)
            v.prefill_time.observe(self.first_token - self.arrival - self.queue_seconds)
            v.decode_time.observe(self.last_token - self.first_token)
            v.request_prompt_tokens.observe(self.prompt_tokens)
            v.request_generation_tokens.observe(self.generated_tokens)
            v.max_generation_tokens.observe(max(c.count for c in completions))
            v.success["length" if any(c.finish_reason == "length" for c in completions) else "stop"].inc()
        else:
            v.success["abort"].inc()
        m.request_prompt_tokens.observe(self.prompt_tokens)
        m.request_generation_tokens.observe(self.generated_tokens)
        m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(self.generated_tokens)
        m.count_request(self.endpoint, outcome)
