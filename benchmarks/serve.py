"""Serving benchmark: the service over HTTP under streaming load, against the offline engine on the same workload.

python benchmarks/serve.py [--out DIR] [--quick] [--levels 1,32,128,256] [--rates 8,24,48,96] [--seconds S]
python benchmarks/serve.py --device cpu --model default [--out DIR]

On the GPU (default), in one run:
1. the offline engine (LLM + benchmarks/generate.py's run_engine) on fixed batches of the workload, all requests
   arriving at once, in a subprocess so that its GPU memory is released before the server starts; there also the
   GPU time of one replay of the engine's batch-1 decode CUDA graph;
2. the server started with its CLI and a fresh empty --compile-cache-dir (cold), stopped, and started again on
   the same directory (warm): seconds from spawn to the first token of a short streamed request;
3. on the warm server, one client's sequential requests (FRESH_PROMPT_WORDS random words each, --fresh-requests
   of each kind) over a new connection per request and over one kept-alive connection: TTFT p50/p99 of each;
4. then closed-loop levels (N clients, each sending its next request when the last one ends) on
   /generate_stream and streaming /v1/chat/completions, then open-loop Poisson arrivals on /generate_stream at
   increasing rates, with goodput: requests/s that met TTFT <= 500 ms and their own ITL p99 <= 50 ms.
The load comes from worker processes (benchmarks/load_generator.py, which also defines what is measured); each
reports its CPU seconds / wall seconds, so a load generator that became the bottleneck shows.

The model is a random Qwen2.5-0.5B-shaped bf16 checkpoint (benchmarks/generate.py) with a word-level tokenizer
of the model's 151936 tokens, token i the word "w<i>": every sampled token is visible text, so a chat stream
carries one content chunk per token, and a prompt of 128 random words is 128 tokens.

--device cpu: the embedded model on the CPU, one start, 10 sequential requests of each connection kind, 32
closed-loop streams on /generate_stream, 32-token prompts and 64 new tokens; the served/offline ratio at 32 streams
is the issue's 2-core check.

Writes serve.json and serve.png to --out, the servers' logs beside them, and prints a table.
"""
import argparse
import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.load_generator import (  # noqa: E402
    CHAT,
    TGI,
    Workload,
    run_level,
    sequential_ttft,
    summarize,
)
from benchmarks.provenance import git_commit  # noqa: E402
from service.config import DEFAULT_MODEL_DIR  # noqa: E402

ENDPOINTS = {"generate_stream": TGI, "chat": CHAT}
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GPU_DEFAULTS = dict(levels="1,32,128,256", endpoints="generate_stream,chat", rates="8,24,48,96", prompt_len=128,
                    new_tokens=256, warmup=2.0, seconds=12.0, drain=5.0, budget_s=450.0, fresh_requests=30)
# The issue's 2-core check. Closed-loop clients that start together move in waves (their prefills together, then
# their decodes): a longer window averages over several.
CPU_DEFAULTS = dict(GPU_DEFAULTS, levels="32", endpoints="generate_stream", rates="", prompt_len=32, new_tokens=64,
                    warmup=3.0, seconds=15.0, drain=30.0, budget_s=0.0, fresh_requests=10)
QUICK = dict(levels="1,8", rates="2,8", warmup=1.0, seconds=3.0)
START_TIMEOUT_S = 300  # a cold GPU start (Triton compiles, prefill autotuning, CUDA graphs) takes about 100 s
LEVEL_OVERHEAD_S = 4.0  # of a level beside its warm-up and window: starting the workers, the drain
MIN_WINDOW_S = 5.0
FRESH_PROMPT_WORDS, FRESH_NEW_TOKENS = 100, 16  # each sequential request's (issue 34: prompts of 100 random words)


# -- the model -------------------------------------------------------------------------------------------------

def write_word_tokenizer(path: Path, vocab_size: int, eos_token_id: int) -> None:
    """A word-level tokenizer of vocab_size tokens: token i is the word "w<i>", except the EOS token at
    eos_token_id and, at the top of the vocabulary, ChatML markers, an unknown-word token and the three role
    words the chat template writes. Words are split at whitespace; with no decoder, decoding joins them with
    single spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = {eos_token_id: "<|endoftext|>", vocab_size - 6: "<|im_start|>", vocab_size - 5: "<|im_end|>",
               vocab_size - 4: "<unk>"}
    roles = dict(zip(range(vocab_size - 3, vocab_size), ("system", "user", "assistant")))
    assert eos_token_id < vocab_size - 6
    vocab = {special.get(i) or roles.get(i) or f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(special.values()))
    tokenizer.save(str(path / "tokenizer.json"))
    # Written by hand rather than by transformers' save_pretrained, whose output differs between versions.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
              "model_max_length": 32768, "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_model(path: Path) -> None:
    """Random Qwen2.5-0.5B-shaped bf16 weights (needs CUDA) with the word-level tokenizer."""
    import torch

    from benchmarks.generate import CONFIG, write_checkpoint

    path.mkdir(parents=True)
    write_checkpoint(path)
    torch.cuda.empty_cache()  # the servers size their KV cache from the GPU memory left free
    write_word_tokenizer(path, CONFIG["vocab_size"], CONFIG["eos_token_id"])


def prompt_words(model_dir: str | None, prompt_len: int) -> tuple[list[str], int, float]:
    """(words, words per prompt, mean prompt tokens) for random prompts of about prompt_len tokens. The words
    are single tokens decoded to text: one token each with the word-level tokenizer; with a subword tokenizer
    they may merge or split, so the words per prompt are calibrated by encoding a few prompts."""
    from service.text import load_tokenizer  # the service's: AutoTokenizer would take config.json's Qwen2Tokenizer

    tokenizer = load_tokenizer(model_dir or DEFAULT_MODEL_DIR)
    rng = random.Random(0)
    ids = rng.sample(range(len(tokenizer)), min(8192, len(tokenizer)))
    words = [w for w in (tokenizer.decode([i], skip_special_tokens=True).strip() for i in ids)
             if w and "\ufffd" not in w and not any(c.isspace() for c in w)]

    def mean_tokens(n_words: int) -> float:
        return sum(len(tokenizer.encode(" ".join(rng.choices(words, k=n_words)))) for _ in range(32)) / 32

    tokens_per_word = mean_tokens(prompt_len) / prompt_len
    n_words = max(1, round(prompt_len / tokens_per_word))
    return words, n_words, mean_tokens(n_words)


# -- the offline engine (run by the --offline-only subprocess) -------------------------------------------------

@functools.cache
def _llm(model_dir: str | None, device: str, tensor_parallel_size: int = 1):
    from service.engine.llm import LLM

    if device == "cpu":
        return LLM(model_dir, device="cpu", tensor_parallel_size=tensor_parallel_size)
    return LLM(model_dir, device="cuda", dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=8192,
               gpu_memory_utilization=0.6, max_model_len=4096,  # as benchmarks/generate.py
               tensor_parallel_size=tensor_parallel_size)


def offline_reference(model_dir: str | None, batches: list[int], prompt_len: int, new_tokens: int,
                      device: str = "cuda", tensor_parallel_size: int = 1) -> dict[int, dict]:
    """run_engine's numbers for each batch size: that many prompts of prompt_len random tokens, all at once."""
    from benchmarks.generate import run_engine

    llm = _llm(model_dir, device, tensor_parallel_size)
    vocab = sorted(set(range(len(llm.tokenizer))) - set(llm.tokenizer.all_special_ids))
    rng = random.Random(0)

    def prompts(n):
        return [rng.choices(vocab, k=prompt_len) for _ in range(n)]

    run_engine(llm, prompts(8), [16] * 8)  # the first steps compile and tune: they belong to no batch
    return {batch: run_engine(llm, prompts(batch), [new_tokens] * batch) for batch in batches}


def graph_step_ms_batch1(model_dir: str | None, tensor_parallel_size: int = 1) -> float | None:
    """GPU time of one replay of the engine's batch-1 decode CUDA graph, median of 200; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    from benchmarks.generate import run_engine

    llm = _llm(model_dir, "cuda", tensor_parallel_size)
    # After one request decodes alone, the graph's inputs hold its last step: a replay repeats that step exactly
    # (the same K/V rewritten into the same slot).
    run_engine(llm, [list(range(1000, 1128))], [16])
    runner = llm.engine.runner
    graph = runner.graphs[1]
    runner._replay_graph(graph)  # as the engine replays it: after kernels/pdl_primer.py's launch, whose effect lasts
    for _ in range(20):
        graph.replay()
    # Events between back-to-back replays: the GPU runs ahead of the launches, so each interval is GPU time only.
    events = [torch.cuda.Event(enable_timing=True) for _ in range(201)]
    events[0].record()
    for event in events[1:]:
        graph.replay()
        event.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(events, events[1:]))
    return times[len(times) // 2]


def offline_main(args) -> None:
    import torch
    import triton

    model_dir = None if args.model == "default" else args.model
    start = time.perf_counter()
    _llm(model_dir, args.device, args.tensor_parallel_size)
    startup = time.perf_counter() - start
    batches = offline_reference(model_dir, args.levels, args.prompt_len, args.new_tokens, args.device,
                                args.tensor_parallel_size)
    for batch, r in batches.items():
        print(f"offline batch {batch:4d}: {r['tok_per_s']:9.0f} tok/s  step {r['decode_step_median_ms']:.2f} ms  "
              f"TTFT {r['ttft_median_ms']:.0f} ms", flush=True)
    cuda = args.device == "cuda"
    tp = args.tensor_parallel_size
    result = {"batches": batches, "graph_step_ms_batch1": graph_step_ms_batch1(model_dir, tp) if cuda else None,
              "engine_startup_s": startup, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "triton": triton.__version__}
    args.json.write_text(json.dumps(result))


def run_offline(args, model_dir: str | None, json_path: Path, env: dict) -> dict:
    argv = [sys.executable, __file__, "--offline-only", "--json", str(json_path), "--device", args.device,
            "--model", model_dir or "default", "--levels", ",".join(map(str, args.levels)),
            "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
            "--tensor-parallel-size", str(args.tensor_parallel_size)]
    subprocess.run(argv, cwd=ROOT, env=env, check=True, timeout=600)
    result = json.loads(json_path.read_text())
    result["batches"] = {int(b): r for b, r in result["batches"].items()}
    return result


# -- the server ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log: object

    def stop(self) -> None:
        """SIGTERM (the server drains and exits), then SIGKILL to whatever is left of its process group."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 60):
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def _wait_healthy(server: Server) -> float:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode} (see its log)")
        try:
            with urllib.request.urlopen(f"{server.base_url}/health", timeout=2):
                return time.monotonic()
        except OSError:  # refused while starting, 503 until the engine runs
            time.sleep(0.1)
    raise RuntimeError(f"the server was not healthy after {START_TIMEOUT_S} s")


def _first_token(server: Server) -> float:
    """When the first token of a short streamed request arrived."""
    body = {"inputs": "w1 w2 w3 w4", "parameters": {"max_new_tokens": 4}}
    with _post(f"{server.base_url}{TGI}", body) as response:
        for line in response:
            if line.startswith(b"data:") and b'"token"' in line:
                return time.monotonic()
    raise RuntimeError("the start-up request streamed no token")


def start_server(args, model_dir: str | None, log_path: Path, env: dict, cache_dir: Path | None,
                 cache_flag: bool) -> tuple[Server, dict]:
    """Starts the server CLI; returns it with the seconds from spawn to healthy and to the first token."""
    port = free_port()
    argv = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--model", model_dir] if model_dir else []
    argv += ["--api-server-count", str(args.api_server_count)] if args.api_server_count else []
    for name in ("tensor_parallel_size", "data_parallel_size"):  # soak.py's args have neither
        if getattr(args, name, 1) > 1:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if cache_dir is not None and cache_flag:
        argv += ["--compile-cache-dir", str(cache_dir)]
    elif cache_dir is not None:  # a server without the flag: point the compilers' own caches there
        env = env | {"TRITON_CACHE_DIR": str(cache_dir / "triton"),
                     "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor")}
    log = open(log_path, "wb")
    spawned = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        healthy = _wait_healthy(server)
        first = _first_token(server)
    except BaseException:
        server.stop()
        raise
    return server, {"healthy_s": healthy - spawned, "first_token_s": first - spawned}


def supports_ignore_eos(workload: Workload) -> bool:
    """One short request with ignore_eos; False when the server rejects the field (422 naming it)."""
    probe = dataclasses.replace(workload, new_tokens=2, ignore_eos=True)
    try:
        with _post(probe.base_url + probe.endpoint, probe.body("w1 w2")) as response:
            response.read()
        return True
    except urllib.error.HTTPError as e:
        if e.code == 422 and b"ignore_eos" in e.read():
            return False
        raise


# -- the run ---------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--model", help="checkpoint directory, or 'default' for the embedded model (the CPU default); "
                                   "unset on the GPU: random Qwen2.5-0.5B-shaped weights, word-level tokenizer")
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    p.add_argument("--levels", help=f"closed-loop concurrencies, also the offline batch sizes "
                                    f"(default {GPU_DEFAULTS['levels']}; CPU {CPU_DEFAULTS['levels']})")
    p.add_argument("--endpoints", help="comma list of: generate_stream, chat (default both; CPU generate_stream)")
    p.add_argument("--rates", help=f"open-loop Poisson rates (requests/s) on /generate_stream, '' for none "
                                   f"(default {GPU_DEFAULTS['rates']}; CPU none)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (default 128; CPU 32)")
    p.add_argument("--new-tokens", type=int, help="tokens generated per request (default 256; CPU 64)")
    p.add_argument("--warmup", type=float, help="seconds of load before each measuring window (default 2; CPU 3)")
    p.add_argument("--seconds", type=float, help="measuring window of each level, shortened to fit --budget-s "
                                                 "(default 12; CPU 15)")
    p.add_argument("--drain", type=float, help="most seconds requests may run past the window (default 5; CPU 30)")
    p.add_argument("--budget-s", type=float, help="skip levels that would end the run past this many seconds "
                                                  "(default 450 on the GPU; 0: no limit, the CPU default)")
    p.add_argument("--fresh-requests", type=int, help="sequential requests over new connections, and as many over "
                                                      "one kept-alive connection; 0: none (default 30; CPU 10)")
    p.add_argument("--loadgen-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="load-generator processes (at most one per closed-loop client; default cores / 2, <= 8)")
    p.add_argument("--api-server-count", type=int, help="HTTP front-end processes of the server (its flag)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="the server's and the offline engine's")
    p.add_argument("--data-parallel-size", type=int, default=1, help="the server's engine cores (the offline "
                   "reference stays one engine: the ratio is then what DP adds over it). Cores sharing one GPU "
                   "need LLM_GPU_MEMORY_UTILIZATION lowered in the environment")
    p.add_argument("--cpu-threads", type=int, help="OMP_NUM_THREADS of the offline engine and the server (default: "
                                                   "torch's, one per core)")
    p.add_argument("--offline-only", action="store_true", help=argparse.SUPPRESS)  # the offline subprocess
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cpu" and args.model is None:
        args.model = "default"
    defaults = (CPU_DEFAULTS if args.device == "cpu" else GPU_DEFAULTS) | (QUICK if args.quick else {})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.levels = [int(c) for c in args.levels.split(",") if c]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.endpoints = [ENDPOINTS[e] for e in args.endpoints.split(",") if e]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.offline_only:
        return offline_main(args)
    began = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    try:
        results = run(args, tmp, began)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["wall_s"] = time.monotonic() - began
    (args.out / "serve.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "serve.png")
    print_table(results)
    print(f"wrote {args.out / 'serve.json'} and {args.out / 'serve.png'} ({results['wall_s']:.0f} s)")
    if any(r["errors"] for r in results["rows"]):
        sys.exit("some requests failed: see first_error in serve.json and the server log")


def run(args, tmp: Path, began: float) -> dict:
    model_dir = None if args.model == "default" else args.model
    if args.model is None:  # the GPU default (on the CPU parse_args makes it "default")
        model_dir = str(tmp / "model")
        write_model(Path(model_dir))
        description = "Qwen2.5-0.5B shape, random bf16 weights, word-level tokenizer (w0..w151935)"
    else:
        description = model_dir or "embedded default model (7.2M-parameter Llama, float32 on the CPU)"
    words, n_words, prompt_tokens = prompt_words(model_dir, args.prompt_len)
    env = {**os.environ, "LLM_DEVICE": args.device, "LLM_LOG_LEVEL": "info",  # the log times start-up phases
           "LLM_FINETUNE_DIR": str(tmp / "finetune")}
    if args.cpu_threads:
        env["OMP_NUM_THREADS"] = str(args.cpu_threads)
    offline = run_offline(args, model_dir, tmp / "offline.json", env)
    rows = [{"mode": "offline", "endpoint": None, "concurrency": b, "tok_per_s": r["tok_per_s"],
             "ttft_p50_ms": r["ttft_median_ms"], "ttft_p99_ms": r["ttft_p99_ms"],
             # run_engine reports the median step of full-batch decode steps only: no p99 to give
             "itl_p50_ms": r["decode_step_median_ms"], "itl_p99_ms": None, "requests": b, "errors": 0}
            for b, r in offline["batches"].items()]
    results = {
        "rows": rows, "startup_cold_s": None, "startup_warm_s": None,
        "graph_step_ms_batch1": offline["graph_step_ms_batch1"],
        "device": args.device, "gpu": offline["gpu"], "torch": offline["torch"], "triton": offline["triton"],
        "git_commit": git_commit(), "model": description, "api_server_count": args.api_server_count,
        "tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size,
        "cpu_threads": args.cpu_threads, "prompt_tokens": prompt_tokens, "new_tokens": args.new_tokens,
        "warmup_s": args.warmup, "drain_s": args.drain,
        "offline_engine_startup_s": offline["engine_startup_s"], "notes": [], "skipped": []}

    server = start_for_load(args, model_dir, env, tmp, results)
    print(f"server ready; startup {results['startup']}", flush=True)
    try:
        results["fresh_connection"] = fresh_connection(args, server, words)
        results["rows"] += load_levels(args, server, words, n_words, results, began)
    finally:
        server.stop()
    results["served_over_offline"] = {
        ep: {str(r["concurrency"]): r["tok_per_s"] / offline["batches"][r["concurrency"]]["tok_per_s"]
             for r in results["rows"] if r["endpoint"] == ep and r.get("concurrency") in offline["batches"]}
        for ep in args.endpoints}
    served = [r for r in results["rows"] if r["mode"] == "served"]
    results["loadgen_cpu_util_max"] = max((u for r in served for u in r["loadgen_cpu_util"]), default=None)
    return results


def start_for_load(args, model_dir: str | None, env: dict, tmp: Path, results: dict) -> Server:
    """On the GPU a cold start on a fresh compile cache, stopped, then the warm start that takes the load; on the
    CPU (no compile caches) one start. Start-up times go into results."""
    if args.device == "cuda":
        help_text = subprocess.run([sys.executable, "-m", "service", "--help"], cwd=ROOT, env=env,
                                   capture_output=True, text=True, timeout=120).stdout
        cache_flag = "--compile-cache-dir" in help_text
        if not cache_flag:
            results["notes"].append("no --compile-cache-dir flag: TRITON_CACHE_DIR/TORCHINDUCTOR_CACHE_DIR used")
        cache = tmp / "compile-cache"
        cache.mkdir()
        server, cold = start_server(args, model_dir, args.out / "serve_server_cold.log", env, cache, cache_flag)
        server.stop()
        server, warm = start_server(args, model_dir, args.out / "serve_server_warm.log", env, cache, cache_flag)
        results |= {"startup_cold_s": cold["first_token_s"], "startup_warm_s": warm["first_token_s"],
                    "startup": {"cold": cold, "warm": warm}}
    else:
        server, start = start_server(args, model_dir, args.out / "serve_server.log", env, None, False)
        results |= {"startup_cold_s": start["first_token_s"], "startup": {"cold": start}}
        results["notes"].append("cpu: one server start (no compile caches), reported as startup_cold_s")
    return server


def fresh_connection(args, server: Server, words: list[str]) -> list[dict]:
    """One client, one request at a time: TTFT over a new connection per request against one kept-alive
    connection (issue 34: a new connection cost 33 ms of TTFT)."""
    if not args.fresh_requests:
        return []
    workload = Workload(server.base_url, TGI, words, FRESH_PROMPT_WORDS, FRESH_NEW_TOKENS, ignore_eos=False)
    rng = random.Random(1)
    prompts = [" ".join(rng.choices(words, k=FRESH_PROMPT_WORDS)) for _ in range(2 * args.fresh_requests + 1)]
    sequential_ttft(workload, prompts[:1], fresh=True)  # a first prompt of this length: nothing measured
    rows = []
    for name, fresh, batch in (("new", True, prompts[1::2]), ("kept_alive", False, prompts[2::2])):
        ttft = 1e3 * np.array(sequential_ttft(workload, batch, fresh))
        rows.append({"connection": name, "requests": len(ttft), "ttft_p50_ms": float(np.percentile(ttft, 50)),
                     "ttft_p99_ms": float(np.percentile(ttft, 99)), "ttft_min_ms": float(ttft.min()),
                     "ttft_max_ms": float(ttft.max())})
        print(f"sequential, {name:10} connection: TTFT p50 {rows[-1]['ttft_p50_ms']:.1f} ms  p99 "
              f"{rows[-1]['ttft_p99_ms']:.1f} ms  ({len(ttft)} requests)", flush=True)
    return rows


def load_levels(args, server: Server, words: list[str], n_words: int, results: dict, began: float) -> list[dict]:
    model = None
    if CHAT in args.endpoints:
        with urllib.request.urlopen(f"{server.base_url}/v1/models", timeout=30) as response:
            model = json.load(response)["data"][0]["id"]
    workloads = {}
    for endpoint in set(args.endpoints) | ({TGI} if args.rates else set()):
        w = Workload(server.base_url, endpoint, words, n_words, args.new_tokens, ignore_eos=True, model=model)
        if not supports_ignore_eos(w):
            w.ignore_eos = False
            results["notes"].append(f"{endpoint}: the server rejects ignore_eos; requests may end at EOS")
        workloads[endpoint] = w
    results["ignore_eos"] = {ep: w.ignore_eos for ep, w in workloads.items()}

    plan = [(ep, "concurrency", c) for ep in args.endpoints for c in args.levels]
    plan += [(TGI, "rate", r) for r in args.rates]
    window = args.seconds
    if args.budget_s and plan:  # one window for all levels, as long as the time left allows
        left = args.budget_s - (time.monotonic() - began)
        window = max(MIN_WINDOW_S, min(window, left / len(plan) - args.warmup - LEVEL_OVERHEAD_S))
    results["window_s"] = window
    rows = []
    for seed, (endpoint, kind, value) in enumerate(plan):
        if args.budget_s and time.monotonic() - began + args.warmup + window + LEVEL_OVERHEAD_S > args.budget_s:
            results["skipped"].append({"endpoint": endpoint, kind: value})
            print(f"skipped {endpoint} {kind} {value}: the run would exceed --budget-s {args.budget_s:.0f}")
            continue
        level = run_level(workloads[endpoint], **{kind: value}, processes=args.loadgen_processes,
                          warmup=args.warmup, seconds=window, drain=args.drain, seed=seed)
        row = {"mode": "served", "endpoint": endpoint, kind: value, **summarize(level)}
        rows.append(row)
        print(f"served {endpoint:21} {kind} {value:>5g}: {row['tok_per_s']:8.0f} tok/s  TTFT p50 "
              f"{_fmt(row['ttft_p50_ms'])} ms  ITL p50 {_fmt(row['itl_p50_ms'], 1)} ms  {row['requests']} requests  "
              f"{row['errors']} errors  load-generator CPU {max(row['loadgen_cpu_util']):.0%}", flush=True)
    return rows


def _fmt(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(results: dict) -> None:
    ratios = results["served_over_offline"]
    print(f"\n{'mode':8} {'endpoint':21} {'conc/rate':>9} {'tok/s':>8} {'x off':>6} {'TTFT p50':>9} {'p99':>7} "
          f"{'ITL p50':>8} {'p99':>6} {'reqs':>6} {'err':>4} {'cut':>4} {'goodput':>8} {'lg cpu':>6}")
    for r in results["rows"]:
        level = f"{r['concurrency']}" if "concurrency" in r else f"{r['rate']:g}/s"
        ratio = ratios.get(r["endpoint"], {}).get(str(r.get("concurrency")))
        lg = f"{max(r['loadgen_cpu_util']):.0%}" if r["mode"] == "served" else "-"
        print(f"{r['mode']:8} {r['endpoint'] or '-':21} {level:>9} {r['tok_per_s']:8.0f} "
              f"{_fmt(ratio, 2):>6} {_fmt(r['ttft_p50_ms']):>9} {_fmt(r['ttft_p99_ms']):>7} "
              f"{_fmt(r['itl_p50_ms'], 1):>8} {_fmt(r['itl_p99_ms'], 1):>6} {r['requests']:>6} {r['errors']:>4} "
              f"{r.get('cut', 0):>4} {_fmt(r.get('goodput_rps'), 1):>8} {lg:>6}")
    print(f"startup cold {_fmt(results['startup_cold_s'], 1)} s, warm {_fmt(results['startup_warm_s'], 1)} s; "
          f"batch-1 decode graph {_fmt(results['graph_step_ms_batch1'], 3)} ms; {results['gpu']}; "
          f"commit {results['git_commit']}")
    for ep, by_level in ratios.items():
        print(f"served/offline tok/s {ep}: " + ", ".join(f"{c}: {x:.2f}x" for c, x in by_level.items()))
    for r in results.get("fresh_connection", []):
        print(f"sequential requests, {r['connection']} connection: TTFT p50 {r['ttft_p50_ms']:.1f} ms, "
              f"p99 {r['ttft_p99_ms']:.1f} ms")
    for note in results["notes"]:
        print(f"note: {note}")


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    offline = [r for r in rows if r["mode"] == "offline"]
    closed = {ep: [r for r in rows if r["endpoint"] == ep and "concurrency" in r]
              for ep in dict.fromkeys(r["endpoint"] for r in rows if r["mode"] == "served")}
    open_loop = [r for r in rows if "rate" in r]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    colors = {ep: f"C{i}" for i, ep in enumerate(closed)}
    ax = axes[0][0]
    ax.plot([r["concurrency"] for r in offline], [r["tok_per_s"] for r in offline], "k^--", label="offline engine")
    for ep, rs in closed.items():
        ax.plot([r["concurrency"] for r in rs], [r["tok_per_s"] for r in rs], "o-", color=colors[ep],
                label=f"served {ep}")
    ax.set_title("generated tokens / s")
    for ax, key, title in ((axes[0][1], "ttft", "time to first token (ms)"),
                           (axes[1][0], "itl", "inter-token latency (ms)")):
        for ep, rs in closed.items():
            for pct, style in (("p50", "o-"), ("p99", "s--")):
                ax.plot([r["concurrency"] for r in rs], [r[f"{key}_{pct}_ms"] for r in rs], style, color=colors[ep],
                        label=f"{ep} {pct}")
        ax.set_title(title)
        ax.set_yscale("log")
    axes[1][0].plot([r["concurrency"] for r in offline], [r["itl_p50_ms"] for r in offline], "k^--",
                    label="offline decode step")
    levels = sorted({r["concurrency"] for r in rows if "concurrency" in r})
    for ax in (axes[0][0], axes[0][1], axes[1][0]):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams (closed loop) / batch size (offline)")
    ax = axes[1][1]
    if open_loop:
        rates = [r["rate"] for r in open_loop]
        ax.plot(rates, rates, ":", color="grey", label="offered")
        ax.plot(rates, [r["achieved_rps"] for r in open_loop], "s--", label="arrived in the window")
        ax.plot(rates, [r["goodput_rps"] for r in open_loop], "o-",
                label="goodput: TTFT <= 500 ms, own ITL p99 <= 50 ms")
    else:
        ax.text(0.5, 0.5, "no open-loop levels", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("goodput, Poisson arrivals on /generate_stream")
    ax.set_xlabel("offered rate (requests / s)")
    ax.set_ylabel("requests / s")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"Serving: {results['model']} ({results['gpu']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
