"""One request cannot take the service from everyone else: it may ask for at most max_request_sequences sequences
(prompts x n, or best_of) and max_request_tokens tokens, and the scheduler gives each request its share of a step's
sequences, so that requests at the cap beside ordinary streams leave those streams' first tokens prompt. Real
server, embedded model, CPU."""
import asyncio
import time

import httpx
import numpy as np
import pytest
from server import serve

NORMAL_STREAMS = 16


@pytest.fixture(scope="module")
def base_url():
    with serve() as url:
        yield url


def test_a_request_beyond_the_caps_is_a_422(base_url):
    r = httpx.post(f"{base_url}/v1/completions", json={"model": "tgi", "prompt": ["a"] * 3, "n": 128})
    assert r.status_code == 422 and r.json()["error"]["param"] == "n", r.text
    assert "max_request_sequences" in r.json()["error"]["message"]
    r = httpx.post(f"{base_url}/v1/completions", json={"model": "tgi", "prompt": ["a"] * 2, "n": 100,
                                                       "max_tokens": 1500})
    assert r.status_code == 422 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "max_request_tokens" in r.json()["error"]["message"]
    # Unset, max_tokens fits the budget instead: 128 chat completions share 262,144 tokens.
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
        "model": "tgi", "messages": [{"role": "user", "content": "hi"}], "n": 128, "max_tokens": None,
        "logprobs": False, "temperature": 1.0, "seed": 1, "stop": ["e"]})
    assert r.status_code == 200, r.text


def test_requests_at_the_cap_leave_ordinary_streams_their_first_tokens(base_url):
    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            async def fan_out(i):
                r = await client.post(f"{base_url}/v1/completions", json={
                    "model": "tgi", "prompt": [f"Story {i}", f"Tale {i}"], "n": 128, "max_tokens": 40,
                    "temperature": 1.0, "seed": i, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return sum(c["finish_reason"] == "length" for c in r.json()["choices"])

            async def stream(i):
                start = time.monotonic()
                body = {"inputs": f"Fortune {i}:", "parameters": {"max_new_tokens": 24, "ignore_eos": True}}
                async with client.stream("POST", f"{base_url}/generate_stream", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            return time.monotonic() - start

            big = [asyncio.ensure_future(fan_out(i)) for i in range(2)]
            await asyncio.sleep(1.0)  # both are running: 512 sequences for 256 places in a step
            ttfts = []
            for _ in range(2):
                ttfts += await asyncio.gather(*(stream(i) for i in range(NORMAL_STREAMS // 2)))
                await asyncio.sleep(0.5)
            return ttfts, await asyncio.gather(*big)

    ttfts, finished = asyncio.run(main())
    assert finished == [256, 256]  # the big requests were served whole
    p99 = float(np.percentile(ttfts, 99))
    assert p99 < 2.0, f"ordinary streams' TTFT p99 {p99:.2f} s beside two requests at the cap: {sorted(ttfts)}"
