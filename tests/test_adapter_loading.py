"""Adapters load at serving speed: the engine core reads adapter files on a thread of its own, so the streams that
run while an adapter loads (POST /v1/load_lora_adapter), or is read again after max_cpu_loras let it go, keep
getting tokens; the load is answered once the file is read, and the adapter calls keep their order."""
import asyncio
import json
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file
from server import scrape, service_process

from service.config import DEFAULT_MODEL_DIR
from service.model.lora import TARGETS

KEY = "adapter-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RANK = 1024  # the highest we serve: the embedded model is small, and its adapter must take long enough to read


def make_big_peft(path, seed: int):
    """A random PEFT adapter of the embedded model on all its projections, its down_proj of a lower rank
    (rank_pattern: padded when it loads), saved in bfloat16 (converted when it loads): 56 MiB."""
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    h, m = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (m, h),
              "up_proj": (m, h), "down_proj": (h, m)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target in TARGETS:
            module = f"base_model.model.model.layers.{layer}.{'self_attn' if target in TARGETS[:4] else 'mlp'}"
            (out, inp), rank = shapes[target], RANK // 2 if target == "down_proj" else RANK
            for which, shape in (("A", (rank, inp)), ("B", (out, rank))):
                weight = torch.randn(shape, generator=generator) * 0.01
                tensors[f"{module}.{target}.lora_{which}.weight"] = weight.to(torch.bfloat16)
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGETS),
        "rank_pattern": {"down_proj": RANK // 2}}))
    return path


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("big-adapters")
    return [make_big_peft(root / f"big{i}", i) for i in range(2)]


class Stream:
    """A long greedy completion of the base model, on a thread: when each of its tokens arrived."""

    def __init__(self, url: str):
        self.url, self.times, self.stop = url, [], threading.Event()
        self.model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        body = {"model": self.model, "prompt": "The sea", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.times.append(time.perf_counter())
                if self.stop.is_set():
                    return

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while len(self.times) < 20 and time.monotonic() < deadline:  # running, past its prefill
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest wait for a token that overlaps [start, end]."""
        times = list(self.times)
        return max(b - a for a, b in zip(times, times[1:]) if b > start and a < end)

    def timed(self, send) -> tuple[httpx.Response, float, float]:
        """send()'s response, how long it took, and the stream's longest wait meanwhile."""
        start = time.perf_counter()
        response = send()
        end = time.perf_counter()
        time.sleep(0.3)  # the token that ends a wait may come after the response
        return response, end - start, self.longest_gap(start, end)


def test_streams_keep_getting_tokens_while_an_adapter_is_read(big):
    """A load, and a request for an adapter that max_cpu_loras let go, each read a 56 MiB file: a stream meanwhile
    waits for no token for anywhere near that long (on the loop thread, each read stalled it throughout)."""
    with service_process(api_key=KEY, max_cpu_loras=1) as service:
        url = service.url

        def load(name, path):
            return lambda: httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                                      json={"lora_name": name, "lora_path": str(path)})

        def ask(name):
            return lambda: httpx.post(f"{url}/v1/completions", timeout=60,
                                      json={"model": name, "prompt": "The sea", "max_tokens": 2})

        with Stream(url) as stream:
            # big0 leaves memory when big1 loads (max_cpu_loras 1): the request for it waits while its file is read
            for what, send in (("load big0", load("big0", big[0])), ("load big1", load("big1", big[1])),
                               ("re-read big0", ask("big0"))):
                response, took, gap = stream.timed(send)
                assert response.status_code == 200, response.text
                assert gap < took / 2, f"{what} took {took * 1000:.0f} ms; the stream waited {gap * 1000:.0f} ms"
            assert stream.thread.is_alive()  # the stream ran throughout
        reads = {dict(labels).get("engine"): value for (name, labels), value in scrape(url).items()
                 if name == "llm_lora_adapter_reads_total"}
        assert reads == {"0": 3}  # the two loads, and big0 read again


def test_adapter_calls_keep_their_order_while_a_file_is_read(big):
    """A call sent while a load's file is read waits for it: an unload sent right after a load unloads what the
    load loaded (answered at once, it would find nothing to unload); a request for the name meanwhile is refused
    (404) or served by the whole adapter, never by half of it."""
    with service_process(api_key=KEY) as service:
        url = service.url

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as client:
                async def call(delay, path, body):
                    await asyncio.sleep(delay)
                    return await client.post(path, json=body)

                return await asyncio.gather(
                    call(0, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(big[0])}),
                    call(0.05, "/v1/unload_lora_adapter", {"lora_name": "x"}),
                    call(0.02, "/v1/completions", {"model": "x", "prompt": "The sea", "max_tokens": 2}))

        load, unload, request = asyncio.run(main())
        assert load.status_code == 200, load.text
        assert unload.status_code == 200, unload.text
        assert request.status_code in (200, 404), request.text
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]][1:] == []
