"""Tensor parallelism on the CPU: a model sharded over 2 ranks (gloo, one worker process beside the engine) makes
the tokens the whole model makes, for KV heads split and replicated (more ranks than KV heads), a padded
vocabulary slice, prefix caching, chunked prefill, overlapped steps and LoRA adapters; through the HTTP API too. A
killed worker takes its engine core down cleanly (errors, 503, exit 1), never into a hang."""
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from server import service_process, sse_events
from tiny_models import make_tiny_model

from service.engine.llm import LLM
from service.model.lora import Adapter, LoRAConfig, add_adapter
from service.model.parallel import TensorParallel, shard_range
from service.protocol import SamplingParams

GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=10, temperature=0.8, seed=7, ignore_eos=True)
# 4 query heads; 2 KV heads split one per rank, or 1 replicated on both; Qwen2 ties its embeddings and has q/k/v
# biases, and a vocabulary of 4099 leaves the second rank's slice 1 padding row
MODELS = {"llama-2kv": ("llama", {}), "qwen2-1kv-odd-vocab": ("qwen2", {"num_key_value_heads": 1, "vocab_size": 4099}),
          "qwen3-1kv": ("qwen3", {"num_key_value_heads": 1})}


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory):
    kind, overrides = MODELS[request.param]
    return make_tiny_model(kind, tmp_path_factory.mktemp(request.param), **overrides)


SHARED = [(7 * i) % 4000 + 5 for i in range(40)]  # 2 full blocks: the prefix cache serves a later prompt


def prompts() -> list[list[int]]:
    return [[11, 12, 13], SHARED + [1, 2, 3], SHARED + [9], list(range(100, 157))]


def generate(model_dir: Path, tp: int, adapter: Path | None = None) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp, max_num_batched_tokens=32,
              async_scheduling=True)  # overlapped: PENDING inputs come from rank 0's sampled tokens
    try:
        if adapter is not None:
            add_adapter(llm.engine.model, "tuned", Adapter.load(adapter, "cpu", torch.float32))
        params = [GREEDY, GREEDY, GREEDY, SAMPLED]
        if adapter is None:
            outs = llm.generate(prompts(), params)
        else:
            ids = [f"r{i}" for i in range(4)]
            for rid, prompt, p in zip(ids, prompts(), params):
                llm.engine.add_request(rid, prompt, p, adapter="tuned")
            tokens = {rid: [] for rid in ids}
            while llm.engine.has_work:
                for out in llm.engine.step()[0]:
                    tokens[out.request_id].append(out.token_id)
            return list(tokens.values())
        again = llm.generate(SHARED + [4], GREEDY)
        assert llm.engine.scheduler.block_manager.prefix_hit_tokens >= 32
        return [o.token_ids for o in outs + again]
    finally:
        llm.engine.close()


def test_two_ranks_make_the_tokens_one_makes(model_dir):
    assert generate(model_dir, 2) == generate(model_dir, 1)


def test_lora_adapters_are_cut_like_their_projections(model_dir, tmp_path):
    """An adapter (every projection, B random so it changes the output) loaded on rank 0 reaches the worker
    through the step's plan, which loads it from its file and keeps its slices."""
    from service.model.loader import load_model

    model = load_model(model_dir, torch.float32, "cpu")
    adapter = Adapter.init(model, LoRAConfig(rank=4, alpha=64.0), seed=1)
    for name, (a, b) in adapter.weights.items():
        b.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    adapter.save(tmp_path / "adapter.safetensors")
    tuned = generate(model_dir, 1, tmp_path / "adapter.safetensors")
    assert tuned != generate(model_dir, 1)
    assert generate(model_dir, 2, tmp_path / "adapter.safetensors") == tuned


def test_shards_cover_each_weight_once_or_replicate_kv_heads():
    from service.model.config import ModelConfig

    cfg = ModelConfig.from_dict({"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64,
                                 "intermediate_size": 96, "num_hidden_layers": 1, "vocab_size": 101})
    for size in (2, 4, 8):
        ranks = [TensorParallel(r, size) for r in range(size)]
        for module, full in (("q_proj", 64), ("o_proj", 64), ("gate_proj", 96), ("down_proj", 96), ("lm_head", 101)):
            cuts = [shard_range(module, cfg, tp)[1:] for tp in ranks]
            assert cuts[0][0] == 0 and cuts[-1][1] == full
            assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:])), (module, size, cuts)
        kv = [shard_range("k_proj", cfg, tp)[1:] for tp in ranks]
        # 2 KV heads of 8 dims: one per rank over 2 ranks, each replicated on size / 2 ranks beyond
        assert kv == [(8 * (r * 2 // size), 8 * (r * 2 // size) + 8) for r in range(size)]


def test_a_model_that_cannot_be_split_is_refused_before_any_process_starts(tmp_path):
    model = make_tiny_model("llama", tmp_path / "m")
    with pytest.raises(ValueError, match="tensor_parallel_size 3 cannot split the model: its 4 query heads"):
        LLM(str(model), device="cpu", tensor_parallel_size=3)


def descendants(pid: int) -> dict[str, int]:
    """{process name: pid} of every process below pid."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = (int(fields[1]), (stat.parent / "comm").read_text().strip())
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = {}, {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in parents.items() if ppid in frontier}
        found |= {parents[p][1]: p for p in frontier}
    return found


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("http-llama"))


@pytest.mark.parametrize("kv_heads", [2, 1])  # split over the ranks; fewer than the ranks, replicated
def test_the_http_api_serves_the_same_greedy_tokens_from_two_ranks(tiny_llama, tmp_path, kv_heads):
    model = tiny_llama if kv_heads == 2 else make_tiny_model("llama", tmp_path / "m", num_key_value_heads=kv_heads)
    body = {"inputs": "A man walks into a bar", "parameters": {"max_new_tokens": 12, "ignore_eos": True,
                                                                "details": True}}
    tokens = {}
    for tp in (1, 2):
        with service_process(model=str(model), tensor_parallel_size=tp) as service:
            if tp == 2:
                assert "llm-tp-worker-1" in descendants(service.process.pid)
            r = httpx.post(f"{service.url}/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            tokens[tp] = [t["id"] for t in r.json()["details"]["tokens"]]
    assert tokens[2] == tokens[1] and len(tokens[1]) == 12


def test_a_killed_worker_fails_the_requests_and_the_service_exits_non_zero(tiny_llama):
    body = {"inputs": "A man walks into a bar", "parameters": {"max_new_tokens": 400, "ignore_eos": True}}
    with service_process(model=str(tiny_llama), tensor_parallel_size=2) as service:
        worker = descendants(service.process.pid)["llm-tp-worker-1"]
        events = []
        start = time.monotonic()
        with httpx.stream("POST", f"{service.url}/generate_stream", json=body, timeout=60) as r:
            for data in sse_events(r):
                events.append(json.loads(data))
                if len(events) == 3:
                    os.kill(worker, signal.SIGKILL)
        assert events[-1].get("error_type") == "generation" and "engine core" in events[-1]["error"], events[-1]
        assert httpx.get(f"{service.url}/health").status_code == 503
        assert service.process.wait(timeout=30) == 1
        assert time.monotonic() - start < 40
        assert "tensor-parallel worker" in service.log.read_text(errors="replace")


def test_ctrl_c_drains_a_sharded_engine_like_any_other(tiny_llama):
    """SIGINT to the whole process group (a terminal's Ctrl-C) reaches the workers too: they must outlive the drain,
    not take their core down under the requests in flight."""
    body = {"inputs": "A man walks into a bar", "parameters": {"max_new_tokens": 48, "ignore_eos": True}}
    with service_process(model=str(tiny_llama), tensor_parallel_size=2) as service:
        with httpx.stream("POST", f"{service.url}/generate_stream", json=body, timeout=60) as r:
            events = sse_events(r)
            json.loads(next(events))
            os.killpg(service.process.pid, signal.SIGINT)
            rest = [json.loads(e) for e in events]
        assert rest[-1]["details"]["generated_tokens"] == 48
        assert service.process.wait(timeout=30) == 0
        assert "tensor-parallel worker" not in service.log.read_text(errors="replace")
