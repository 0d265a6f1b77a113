"""Load test of the service: TGI /generate, TGI /generate_stream and streaming OpenAI /v1/chat/completions.

    locust -f loadtest/locustfile.py --headless -u 8 -r 4 -t 30s --host http://127.0.0.1:8000 --csv out/locust

Each user sends requests drawn from a mix of workloads (short chat, long-prompt summarisation, long
generation); every prompt starts with the same instructions, as behind a deployed assistant, so the prefix
cache has something to find. Streaming users also report time to first token and every inter-token gap as
request types "TTFT" and "ITL" (named after the endpoint), so they get their own rows, percentiles and CSV lines.
A stream counts as failed on a non-200 status, an error event, or a missing final event. Requests are sized to
the served model: each user reads the context length from GET /info, and prompts and outputs are capped so they
always fit it (the caps below can only lower them).

Environment:
    LOADTEST_MIX               workload weights, e.g. "chat:6,summarise:2,long_generation:2" (default)
    LOADTEST_MAX_NEW_TOKENS    cap on max_new_tokens of every request (e.g. 8 for a quick CPU run)
    LOADTEST_MAX_PROMPT_WORDS  cap on the words after the shared instructions
    LOADTEST_HEALTH_TIMEOUT    seconds to wait for GET /health before starting (default 60)
"""
import json
import os
import random
import sys
import time
import urllib.request
from dataclasses import dataclass

from locust import HttpUser, between, events, task
from requests.exceptions import RequestException


@dataclass(frozen=True)
class Workload:
    prompt_words: tuple[int, int]      # uniform range, inclusive
    max_new_tokens: tuple[int, int]


WORKLOADS = {
    "chat": Workload(prompt_words=(8, 64), max_new_tokens=(16, 128)),
    "summarise": Workload(prompt_words=(400, 1500), max_new_tokens=(32, 128)),
    "long_generation": Workload(prompt_words=(8, 32), max_new_tokens=(256, 768)),
}

WORDS = ("the model serves tokens from a paged cache while the scheduler batches requests of every length "
         "attention reads blocks of keys and values written by earlier steps so long prompts share memory "
         "with short ones and nothing waits longer than it must").split()
INSTRUCTIONS = ("You are a helpful assistant of the serving team. Answer briefly and precisely, say so when you do "
                "not know, and never invent numbers. Use plain words and short sentences.")


def _parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for item in text.split(","):
        name, _, weight = item.partition(":")
        if name.strip() not in WORKLOADS:
            raise ValueError(f"LOADTEST_MIX: unknown workload {name.strip()!r}; known: {', '.join(WORKLOADS)}")
        mix[name.strip()] = float(weight or 1)
    return mix


MIX = _parse_mix(os.environ.get("LOADTEST_MIX", "chat:6,summarise:2,long_generation:2"))
MAX_NEW_TOKENS_CAP = int(os.environ.get("LOADTEST_MAX_NEW_TOKENS", "0")) or None
MAX_PROMPT_WORDS_CAP = int(os.environ.get("LOADTEST_MAX_PROMPT_WORDS", "0")) or None
HEALTH_TIMEOUT = float(os.environ.get("LOADTEST_HEALTH_TIMEOUT", "60"))


# Upper bounds of the prompt's token count, whatever the tokenizer: no word of WORDS takes more than 4 tokens (the
# embedded model's, the worst seen), nor the instructions more than 64 (49 there), nor a chat template more than
# 32 around them.
TOKENS_PER_WORD, INSTRUCTION_TOKENS, TEMPLATE_TOKENS = 4, 64, 32


def sample_request(rng: random.Random, context_tokens: int | None = None) -> tuple[str, int]:
    """A prompt (the shared instructions, then random words) and a max_new_tokens from the workload mix, fitted
    into context_tokens when given."""
    workload = WORKLOADS[rng.choices(list(MIX), weights=list(MIX.values()))[0]]
    n_words = rng.randint(*workload.prompt_words)
    if MAX_PROMPT_WORDS_CAP:
        n_words = min(n_words, MAX_PROMPT_WORDS_CAP)
    max_new_tokens = rng.randint(*workload.max_new_tokens)
    if MAX_NEW_TOKENS_CAP:
        max_new_tokens = min(max_new_tokens, MAX_NEW_TOKENS_CAP)
    if context_tokens:
        max_new_tokens = min(max_new_tokens, context_tokens // 4)
        room = context_tokens - max_new_tokens - INSTRUCTION_TOKENS - TEMPLATE_TOKENS
        n_words = max(1, min(n_words, room // TOKENS_PER_WORD))
    return INSTRUCTIONS + " " + " ".join(rng.choices(WORDS, k=n_words)), max_new_tokens


@events.init.add_listener
def _wait_for_health(environment, **_):
    # On init, before the run-time clock starts: a slow model load does not eat into the run.
    options = environment.parsed_options
    if not environment.host or (options is not None and options.worker):
        return
    url = environment.host.rstrip("/") + "/health"
    deadline = time.monotonic() + HEALTH_TIMEOUT
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"{url} not healthy after {HEALTH_TIMEOUT:.0f} s")
            time.sleep(1)


def _sse_data(lines):
    """The payloads of the `data:` lines of a server-sent event stream."""
    for line in lines:
        if line.startswith(b"data:"):
            yield line[5:].strip()


class _LLMUser(HttpUser):
    abstract = True
    wait_time = between(0.05, 0.5)

    def on_start(self):
        self.rng = random.Random()
        self.context_tokens = self.client.get("/info").json()["max_total_tokens"]

    def sample(self) -> tuple[str, int]:
        return sample_request(self.rng, self.context_tokens)

    def _stream(self, path: str, body: dict, is_final):
        """POSTs a streaming request; reports TTFT, each ITL, and the whole stream as one request."""
        start = time.perf_counter()
        arrivals = []
        with self.client.post(path, json=body, stream=True, catch_response=True, name=path) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            finished, n_bytes = False, 0
            try:
                for data in _sse_data(response.iter_lines()):
                    n_bytes += len(data)
                    if data == b"[DONE]":
                        finished = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        response.failure(f"error event: {event['error']}")
                        return
                    if _has_token(event):
                        arrivals.append(time.perf_counter())
                    finished = finished or is_final(event)
            except (RequestException, ValueError) as e:  # connection lost mid-stream, or a malformed event
                response.failure(f"broken stream: {e!r}")
                return
            # The whole stream, not just the headers, is the request's response time.
            response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            response.request_meta["response_length"] = n_bytes
            if not finished:
                response.failure("stream ended without its final event")
                return
        if arrivals:  # none when the first token ended the request (EOS): a valid, empty answer
            self._report("TTFT", path, arrivals[0] - start)
        for before, after in zip(arrivals, arrivals[1:]):
            self._report("ITL", path, after - before)

    def _report(self, kind: str, name: str, seconds: float):
        events.request.fire(request_type=kind, name=name, response_time=seconds * 1000, response_length=0,
                            exception=None, context={})


def _has_token(event: dict) -> bool:
    if "token" in event:                                    # TGI: one token per event
        return True
    choices = event.get("choices") or [{}]                  # OpenAI: a content delta
    return bool(choices[0].get("delta", {}).get("content"))


class GenerateUser(_LLMUser):
    """TGI /generate: the whole text in one response."""

    @task
    def generate(self):
        prompt, max_new_tokens = self.sample()
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
        with self.client.post("/generate", json=body, catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
            elif "generated_text" not in response.json():
                response.failure("no generated_text")


class GenerateStreamUser(_LLMUser):
    """TGI /generate_stream: one SSE event per token, the last one carrying generated_text."""

    @task
    def generate_stream(self):
        prompt, max_new_tokens = self.sample()
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
        self._stream("/generate_stream", body, is_final=lambda event: event.get("generated_text") is not None)


class ChatStreamUser(_LLMUser):
    """OpenAI /v1/chat/completions with stream=true: delta chunks, then data: [DONE]."""

    def on_start(self):
        super().on_start()
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]

    @task
    def chat(self):
        prompt, max_new_tokens = self.sample()
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_new_tokens, "stream": True}
        self._stream("/v1/chat/completions", body, is_final=lambda event: False)
