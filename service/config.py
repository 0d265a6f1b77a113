"""Every setting of the service, from the command line (--model ...) or the environment (LLM_MODEL=...)."""
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

ROUTE_GROUPS = ("generate", "openai", "finetune", "metrics")  # what api_key_routes may name
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"


def local_model_dir(model: str | None) -> Path | None:
    """The model's directory when it is known without a download (the embedded model, or a directory)."""
    if model is None:
        return DEFAULT_MODEL_DIR
    return Path(model) if Path(model).is_dir() else None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLM_", cli_kebab_case=True, cli_implicit_flags=True, extra="ignore")

    # model
    model: str | None = Field(None, description="HF directory or hub id; the embedded default model when unset")
    served_model_name: str | None = Field(None, description="name reported by /v1/models (default: the model's)")
    dtype: str = Field("auto", description="auto | bfloat16 | float16 | float32")
    device: str = Field("auto", description="auto | cuda | cpu")
    max_model_len: int | None = Field(None, description="context length (default: the model's)")

    # scale-out
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs (CPU processes) one model is sharded over: the "
                                      "engine core drives one worker process per further rank (NCCL on CUDA, gloo "
                                      "on the CPU)")
    data_parallel_size: int = Field(1, ge=1, description="engine cores behind the front-ends, each with its own "
                                    "GPU(s) and KV cache; a request goes to the least-loaded core, or to the one "
                                    "that holds its prompt's prefix")

    # KV cache and scheduling
    block_size: int = Field(16, description="tokens per KV block: a power of two, 16..256 (the kernels' range)")
    num_kv_blocks: int | None = Field(None, description="explicit KV block count (default: sized from memory)")
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1)
    cpu_kv_cache_bytes: int = Field(256 << 20, description="KV cache budget on CPU")
    max_num_seqs: int = Field(256, description="most sequences in one step")
    max_num_batched_tokens: int = Field(8192, description="token budget of one step (prefill chunks + decodes)")
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    cuda_graph_max_prefill_tokens: int = Field(2048, ge=0, description="prefill and mixed steps of up to this many "
                                               "tokens replay CUDA graphs too (0: they run eagerly)")
    max_mixed_step_tokens: int | None = Field(None, ge=1, description="most tokens of a step that carries decodes "
                                              "(prompts get what the decodes leave). Default: the largest prefill "
                                              "CUDA graph (if it holds 2 * max_num_seqs), so that such steps replay "
                                              "one and decodes never wait on a long eager step; else "
                                              "max_num_batched_tokens")
    admission_hold_steps: int | None = Field(None, ge=0, description="while sequences decode, a new request waits "
                                             "up to this many steps to be admitted with others (unless enough "
                                             "prompt tokens wait to fill a step): on CUDA a step carrying prompts "
                                             "costs ~1.5x a decode step however many it carries. 0: admitted at "
                                             "once. Default: 8 on CUDA, 0 on the CPU (whose steps cost what "
                                             "their tokens do)")
    async_scheduling: bool | None = Field(None, description="schedule and prepare step N+1 while the GPU runs step "
                                          "N (default: on for CUDA, off on the CPU, where nothing runs beside)")
    kv_events_endpoint: str | None = Field(None, description="publish the prefix cache's block stored / removed / "
                                           "cleared events (vLLM's KV events: msgpack over a ZeroMQ PUB socket) "
                                           "here, for a prefix-aware router: tcp://*:5557 binds (core K on port "
                                           "+ K), tcp://router:5557 connects (every core). Unset: none")
    kv_events_topic: str = Field("", description="topic frame of every KV-event message (llm-d's indexer "
                                 "wants kv@<pod>@<model>)")
    scheduling_policy: Literal["fcfs", "priority"] = Field("fcfs", description="fcfs: requests wait in arrival "
                                                           "order; priority: by their `priority` (lower first), "
                                                           "and the lowest are preempted first")
    stream_interval: int = Field(1, ge=1, description="streamed responses send a request's tokens every N tokens "
                                 "(its first at once, its last when it ends): fewer, larger events")
    max_loras: int = Field(8, ge=0, description="LoRA adapters a step may serve, each from a slot on the device "
                           "(allocated at start; their steps replay CUDA graphs of their own): more distinct "
                           "adapters wait for a slot; 0: adapters are served eagerly")
    max_lora_rank: int = Field(16, ge=1, le=256, description="highest LoRA rank a slot holds (memory grows with it); "
                               "adapters of higher rank, and dense ones, are served eagerly")
    speculative_method: Literal["ngram", "draft_model"] | None = Field(
        None, description="speculative decoding: ngram proposes the tokens that followed the latest earlier "
        "occurrence of a sequence's last tokens (prompt lookup); draft_model has a smaller model "
        "(speculative_model) decode them greedily; the model verifies them in one step. Unset: off")
    speculative_model: str | None = Field(None, description="the draft model of speculative_method draft_model: HF "
                                          "directory or hub id, with the model's vocabulary (vLLM's name). It runs on "
                                          "the model's device and dtype, with a KV cache and CUDA graphs of its own")
    num_speculative_tokens: int = Field(3, ge=1, le=32, description="most draft tokens verified per sequence and "
                                        "step (speculative_method)")
    prompt_lookup_min: int = Field(2, ge=1, description="shortest suffix the ngram proposer looks up (vLLM's name)")
    prompt_lookup_max: int = Field(4, ge=1, description="longest suffix the ngram proposer looks up, tried first "
                                   "(vLLM's name)")
    # 16: on the H100 (35dff4c) speculation at 128 streams without a limit halved tok/s; verifies of 4 tokens cost
    # 1.1x a decode step at batch 1 but 1.9-2.0x at 8 and 32, and at 32 streams real n-gram drafts (about half
    # accepted) lost 47% (benchmarks/spec.py, results README)
    speculative_disable_by_batch_size: int | None = Field(16, ge=1, description="steps with this many running "
                                                          "sequences or more decode without speculation (a large "
                                                          "batch is compute-bound); more than max_num_seqs: never")
    speculative_min_acceptance: float = Field(0.15, ge=0, le=1, description="a sequence whose average accepted "
                                              "fraction of draft tokens falls below this stops proposing for 8 "
                                              "tokens, twice as many after each failed retry (up to 64). 0: never")
    compile_cache_dir: str = Field("~/.cache/tritonserve", description="compiled Triton kernels and autotuning "
                                   "results, kept across restarts so a warm start skips compiling and autotuning")

    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    api_server_count: int | None = Field(None, ge=1, description="HTTP front-end processes on the port, all attached "
                                         "to the one engine core (default: half the usable CPUs, 1 to 8)")
    max_waiting_requests: int = Field(512, description="beyond this, 429")
    max_request_bytes: int = Field(1 << 20, description="request body limit")
    max_stop_sequences: int = 16
    max_request_sequences: int = Field(256, ge=1, description="sequences one request may ask for: prompts x n (or "
                                       "best_of); beyond, 422")
    max_request_tokens: int = Field(262144, ge=1, description="tokens one request may ask for: its prompts' tokens "
                                    "plus max_tokens for each of its sequences; beyond, 422")
    max_grammar_bytes: int = Field(65536, ge=1, description="longest JSON schema or regular expression a request "
                                   "may constrain its output with; beyond, 400")
    grammar_compile_timeout: float = Field(10.0, gt=0, description="seconds a grammar may take to compile; beyond, "
                                           "the request gets 400 and the same grammar is refused at once from then on")
    grammar_cache_bytes: int = Field(128 << 20, ge=1 << 20, description="memory for compiled grammars: the cache "
                                     "of recent ones (least recently used go first), and as much again for those "
                                     "of running requests (a request whose grammar does not fit waits)")
    max_concurrent_requests: int = Field(4096, ge=1, description="requests one front-end serves at once; beyond, "
                                         "503 (each holds a connection and a file descriptor)")
    header_timeout: float = Field(10.0, gt=0, description="seconds a connection has to send a request's headers, "
                                  "from its opening or its previous response (slow clients hold no descriptor)")
    body_timeout: float = Field(60.0, gt=0, description="seconds a request has to send its whole body (408 after)")
    keep_alive_timeout: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection stays open")
    drain_seconds: float = Field(30.0, ge=0, description="on SIGTERM/SIGINT: how long running requests may take to "
                                 "finish before they end with an error")
    api_key: str | None = Field(None, description="Bearer key; required on the route groups in api_key_routes "
                                "(and on /docs and /openapi.json)")
    api_key_routes: str = Field("finetune", description="comma list of: generate, openai, finetune, metrics")
    log_level: str = "info"

    # fine-tuning
    finetune_dir: str = Field("./finetune-data", description="uploaded files, jobs and adapters")
    finetune_max_file_bytes: int = Field(32 << 20, gt=0, description="largest training file accepted")
    finetune_duty_cycle: float = Field(0.5, gt=0, le=1, description="most of the time training may take while "
                                       "requests are being served")
    finetune_max_files: int = Field(1000, ge=1, description="training files kept (DELETE /v1/files/{id} frees one)")
    finetune_max_jobs: int = Field(1000, ge=1, description="fine-tuning jobs kept, finished ones included")
    finetune_max_messages: int = Field(256, ge=1, description="messages per chat example of a training file")
    lora_modules: list[str] = Field([], description="LoRA adapters served from the start, as name=path (a PEFT "
                                    "adapter's directory, or one of our adapter files), on every engine core: "
                                    "--lora-modules a=/p --lora-modules b=/q, or a JSON list "
                                    "(LLM_LORA_MODULES='[\"a=/p\", \"b=/q\"]')")
    max_cpu_loras: int | None = Field(None, ge=1, description="LoRA adapters whose weights stay loaded (least "
                                      "recently used first out); a request for another reloads it from its path. "
                                      "Default: every served adapter stays loaded")

    @field_validator("model", "speculative_model", mode="before")
    @classmethod
    def _empty_model_is_default(cls, value):
        # Compose passes LLM_MODEL through as "" when the host leaves it unset.
        return value or None

    @field_validator("lora_modules")
    @classmethod
    def _name_equals_path(cls, value: list[str]) -> list[str]:
        bad = [m for m in value if not all(m.partition("=")[::2])]
        if bad:
            raise ValueError(f"lora_modules: expected name=path, got {bad[0]!r}")
        return value

    @field_validator("kv_events_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_endpoint: expected tcp://, ipc:// or inproc://, got {value!r}")
        return value or None

    @field_validator("api_key_routes")
    @classmethod
    def _known_route_groups(cls, value: str) -> str:
        unknown = {g.strip() for g in value.split(",") if g.strip()} - set(ROUTE_GROUPS)
        if unknown:
            raise ValueError(f"api_key_routes: unknown route groups {sorted(unknown)}; "
                             f"known: {', '.join(ROUTE_GROUPS)}")
        return value

    @model_validator(mode="after")
    def _lookup_range(self):
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self

    @model_validator(mode="after")
    def _draft_model(self):
        # Its vocabulary is checked against the model's when the engine starts (the checkpoints are needed).
        drafting = self.speculative_method == "draft_model"
        if drafting and self.speculative_model is None:
            raise ValueError("speculative_method draft_model needs speculative_model: the draft model's directory "
                             "or hub id")
        if self.speculative_model is not None and not drafting:
            raise ValueError(f"speculative_model is the draft model of speculative_method draft_model, not of "
                             f"{self.speculative_method!r}")
        return self

    @field_validator("block_size")
    @classmethod
    def _block_size_in_kernel_range(cls, value: int) -> int:
        if not 16 <= value <= 256 or value & (value - 1):
            raise ValueError(f"block_size must be a power of two in 16..256, got {value}")
        return value


# Every limit a client can run into: its setting, what it bounds, and what a request beyond it gets. The README's
# Limits table says the same; /openapi.json says it with the running server's values.
LIMITS = (
    ("max_request_bytes", "bytes of a request body", "413"),
    ("body_timeout", "seconds to send a request's body", "408"),
    ("header_timeout", "seconds to send a request's headers", "the connection is closed"),
    ("keep_alive_timeout", "seconds an idle keep-alive connection stays open", "the connection is closed"),
    ("max_concurrent_requests", "requests one front-end serves at once", "503 with Retry-After"),
    ("max_waiting_requests", "requests waiting to run, those whose grammar compiles included", "429 overloaded"),
    ("max_model_len", "tokens of a prompt plus max_tokens", "422 context_length_exceeded"),
    ("max_request_sequences", "sequences of one request: prompts x n (or best_of)", "422"),
    ("max_request_tokens", "tokens of one request: its prompts' plus max_tokens for every sequence (an unset "
     "max_tokens is lowered to fit)", "422"),
    ("max_stop_sequences", "stop strings of a request", "422"),
    ("max_grammar_bytes", "bytes of a JSON schema or regular expression (response_format, a tool's parameters, "
     "TGI's grammar)", "400 invalid_grammar"),
    ("grammar_compile_timeout", "seconds a grammar may take to compile; the same grammar is refused at once "
     "afterwards", "400 invalid_grammar"),
    ("grammar_cache_bytes", "memory of compiled grammars: the cache, and as much for running requests' grammars",
     "the request waits (counted as waiting)"),
    ("finetune_max_file_bytes", "bytes of a training file", "413"),
    ("finetune_max_files", "training files kept", "400 limit_reached"),
    ("finetune_max_jobs", "fine-tuning jobs kept", "400 limit_reached"),
    ("finetune_max_messages", "messages of a chat example in a training file", "400"),
)


def usable_cpus() -> int:
    """The CPUs this process may run on (a container's cpuset, not the whole host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_api_server_count() -> int:
    """One front-end per two CPUs: the engine core needs one of its own, each front-end up to one at full load
    (one streams 10-15k tokens/s: four capped the H100 at 46k at 256 streams), and the rest is left to the
    clients' side of the host, tokenizer threads and the system."""
    return max(1, min(8, usable_cpus() // 2))


def load_settings(argv: list[str] | None = None) -> Settings:
    """Settings from CLI arguments (argv) over environment variables over defaults."""
    return CliApp.run(Settings, cli_args=argv if argv is not None else [])
