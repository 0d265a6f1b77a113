"""LoRA adapters served while the server runs (vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter) and
from the start (lora_modules), on the CPU with a tiny random Llama: a PEFT adapter gives the logprobs that
transformers + PEFT give for it (plain, rsLoRA, two targets, ranks per module); a bad path or file gets a 4xx naming
what is wrong and leaves the served adapters as they were; requests keep the adapter they began with while it is
unloaded and loaded again, and new ones get 404 meanwhile; under data parallelism every core serves every adapter (a
fine-tuning job's too) and under tensor parallelism every rank, with the outputs of one core; the API key guards the
routes."""
import asyncio
import json
import shutil
import time

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file, save_file
from server import scrape, service_process
from tiny_models import make_tiny_model

from service.api.engine_client import EngineClient
from service.config import Settings
from service.engine.core import EngineCore
from service.engine.llm import LLM
from service.engine.llm_engine import AdapterError, AdapterNotServed
from service.metrics import FrontendMetrics
from service.model.fingerprint import fingerprint
from service.model.loader import load_model
from service.model.lora import TARGETS, Adapter, LoRAConfig
from service.protocol import EngineInfo, SamplingParams

KEY = "adapter-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Tell me a fortune about the sea."}]
STEPS = 4  # greedy tokens compared with transformers + PEFT
TOLERANCE = 2e-4  # logprobs, float32 on the CPU
# PEFT LoraConfig options of each adapter (init_lora_weights=False: B is random, so each one changes the output)
PEFT = {"all": dict(r=8, lora_alpha=16), "rslora": dict(r=8, lora_alpha=16, use_rslora=True),
        "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "ranks": dict(r=8, lora_alpha=16, rank_pattern={"q_proj": 4, "down_proj": 2})}


def make_peft(base, path, seed: int = 0, **options):
    """A random PEFT LoRA adapter of the checkpoint at base, saved as PeftModel.save_pretrained does."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(**{"target_modules": list(TARGETS), "init_lora_weights": False, **options})
    get_peft_model(model, config).save_pretrained(path)
    return path


def peft_greedy(base, adapter, prompt: list[int], steps: int) -> list[tuple[int, list[float]]]:
    """transformers + PEFT, greedy: each step's token and its 5 highest logprobs."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            top = model.eval()(torch.tensor([ids])).logits[0, -1].log_softmax(-1).topk(5)
            out.append((top.indices[0].item(), top.values.tolist()))
            ids.append(out[-1][0])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_peft(tiny, root / name, seed, **options) for seed, (name, options) in enumerate(PEFT.items())}


@pytest.fixture(scope="module")
def server(tiny, adapters):
    # max_cpu_loras 2: the adapters of these tests take turns in memory, reloaded from their files
    with service_process(model=str(tiny), dtype="float32", api_key=KEY, max_cpu_loras=2) as service:
        for name, path in adapters.items():
            load(service.url, name, path).raise_for_status()
        yield service.url


def load(url: str, name: str, path, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=headers, timeout=60)


def unload(url: str, name: str, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60)


def chat(url: str, model: str, steps: int = STEPS) -> list[list[float]]:
    """Greedy chat tokens' 5 highest logprobs, step by step."""
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": MESSAGES, "max_tokens": steps, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 200, r.text
    return [sorted((t["logprob"] for t in step["top_logprobs"]), reverse=True)
            for step in r.json()["choices"][0]["logprobs"]["content"]]


def completion(url: str, model: str, prompt: list[int], max_tokens: int = 8) -> tuple[str, list[float]]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def base_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def assert_close(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, abs=TOLERANCE), f"step {step}: {g} != {w}"


# -- PEFT adapters against transformers + PEFT --------------------------------------------------------------

@pytest.mark.parametrize("name", list(PEFT))
def test_a_peft_adapter_gives_the_logprobs_of_transformers_and_peft(server, tiny, adapters, name):
    prompt = httpx.post(f"{server}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    want = peft_greedy(tiny, adapters[name], prompt, STEPS)
    assert_close(chat(server, name), [top for _, top in want])
    base = [top for _, top in peft_greedy(tiny, None, prompt, STEPS)]
    assert max(abs(a - b) for tops in zip(base, [t for _, t in want]) for a, b in zip(*tops)) > 100 * TOLERANCE


def test_models_lists_the_adapters_with_their_parent(server):
    cards = httpx.get(f"{server}/v1/models").json()["data"]
    base = cards[0]["id"]
    assert [c["id"] for c in cards] == [base, *PEFT] and "parent" not in cards[0]
    assert all(c["parent"] == base for c in cards[1:])


def test_the_api_key_guards_loading_and_unloading(server, adapters):
    for call in (lambda: load(server, "guarded", adapters["all"], headers={}),
                 lambda: unload(server, "all", headers={"Authorization": "Bearer wrong"})):
        r = call()
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "guarded" not in [c["id"] for c in httpx.get(f"{server}/v1/models").json()["data"]]
    assert chat(server, "all")  # generation stays open: "finetune" is the only protected group here


# -- bad requests ------------------------------------------------------------------------------------------

def _edited_copy(source, path, config=None, tensors=None):
    """A copy of a PEFT adapter with config entries replaced and tensors edited (tensors(dict) -> dict)."""
    shutil.copytree(source, path)
    if config is not None:
        edited = {**json.loads((path / "adapter_config.json").read_text()), **config}
        (path / "adapter_config.json").write_text(json.dumps(edited))
    if tensors is not None:
        save_file(tensors(load_file(path / "adapter_model.safetensors")), path / "adapter_model.safetensors")
    return path


def test_bad_paths_and_files_get_a_4xx_naming_the_problem(server, tiny, adapters, tmp_path):
    before = httpx.get(f"{server}/v1/models").json()
    served = chat(server, "all")
    bin_only = _edited_copy(adapters["qv"], tmp_path / "bin-only")
    (bin_only / "adapter_model.safetensors").rename(bin_only / "adapter_model.bin")

    def truncated_a(tensors):
        key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
        return {**tensors, key: tensors[key][:3]}

    other = make_tiny_model("llama", tmp_path / "other-base", intermediate_size=96)  # the MLP's shapes differ
    retrained = load_model(make_tiny_model("llama", tmp_path / "same-shapes", seed=1), torch.float32, "cpu")
    theirs = Adapter.init(retrained, LoRAConfig(rank=4), seed=1)
    theirs.save(tmp_path / "theirs.safetensors", base=fingerprint(retrained))
    cases = [  # (name, path, status, what the message says)
        ("x", tmp_path / "nowhere", 404, "No adapter found for"),
        ("x", tiny / "config.json", 400, "is not a safetensors file"),
        ("x", tiny / "model.safetensors", 400, "not one of our adapters"),
        ("x", tiny, 400, "has no adapter_config.json"),
        ("x", bin_only, 400, "only adapter_model.bin"),
        ("x", make_peft(tiny, tmp_path / "dora", use_dora=True), 400, "use_dora=true is not supported"),
        ("x", make_peft(tiny, tmp_path / "saved", target_modules=["q_proj"], modules_to_save=["lm_head"]), 400,
         "modules_to_save"),
        ("x", make_peft(tiny, tmp_path / "head", target_modules=["q_proj", "lm_head"]), 400,
         "target_modules ['lm_head'] are not served"),
        ("x", _edited_copy(adapters["qv"], tmp_path / "alphas", config={"alpha_pattern": {"q_proj": 3}}), 400,
         "alpha_pattern"),
        ("x", _edited_copy(adapters["qv"], tmp_path / "cut", tensors=truncated_a), 400, "needs lora_A [r, in]"),
        ("x", make_peft(other, tmp_path / "for-other"), 400, "was made for another base model"),
        ("x", tmp_path / "theirs.safetensors", 400, "its base model is"),
        ("all", adapters["qv"], 400, "The lora adapter 'all' has already been loaded."),
        (before["data"][0]["id"], adapters["qv"], 400, "is the base model's name"),
        ("tgi", adapters["qv"], 400, "stands for the base model"),
        ("", adapters["qv"], 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ]
    for name, path, status, message in cases:
        r = load(server, name, path)
        assert r.status_code == status and message in r.json()["error"]["message"], (path, r.text)
    r = unload(server, "never-loaded")
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'never-loaded' cannot be found."
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "x"}, headers=AUTH)
    assert r.status_code == 422 and r.json()["error"]["param"] == "lora_path"
    assert httpx.get(f"{server}/v1/models").json() == before  # nothing served changed
    assert_close(chat(server, "all"), served)


def test_our_own_adapter_files_load_too(server, tiny, tmp_path):
    model = load_model(tiny, torch.float32, "cpu")
    ours = Adapter.init(model, LoRAConfig(rank=4, targets=("q_proj", "up_proj")), seed=3)
    for _, b in ours.weights.values():
        b.data.normal_(0, 0.5)
    ours.save(tmp_path / "ours.safetensors", base=fingerprint(model))
    assert load(server, "ours", tmp_path / "ours.safetensors").status_code == 200
    try:
        assert chat(server, "ours") != chat(server, base_model(server))
    finally:
        assert unload(server, "ours").status_code == 200


# -- unloading under load ----------------------------------------------------------------------------------

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def _run(engine, requests: dict[str, str]) -> dict[str, list[int]]:
    tokens = {rid: [] for rid in requests}
    while engine.has_work:
        for out in engine.step()[0]:
            tokens[out.request_id].append(out.token_id)
    return tokens


def test_an_unloaded_adapter_serves_its_running_requests_to_their_end(tiny, adapters):
    """In the engine: a request keeps the adapter it was admitted with while its name is unloaded and loaded again
    from another file; new requests meanwhile are refused; max_cpu_loras lets unused adapters go and reloads them."""
    prompt = [5, 17, 300, 42, 99, 7, 1200, 64]
    want = {name: [t for t, _ in peft_greedy(tiny, adapters[name], prompt, GREEDY.max_new_tokens)]
            for name in ("all", "qv")}
    llm = LLM(str(tiny), device="cpu", dtype="float32", max_cpu_loras=1)
    engine = llm.engine
    try:
        engine.load_adapter("x", str(adapters["all"]))
        engine.add_request("old", prompt, GREEDY, adapter="x")
        first = [out.token_id for out in engine.step()[0]]  # the CPU steps synchronously: its first token
        engine.unload_adapter("x")
        with pytest.raises(AdapterNotServed):
            engine.add_request("refused", prompt, GREEDY, adapter="x")
        engine.load_adapter("x", str(adapters["qv"]))
        engine.add_request("new", prompt, GREEDY, adapter="x")
        assert len(engine.model.lora_adapters) == 2  # both in use: beyond max_cpu_loras until the old one ends
        tokens = _run(engine, {"old": "x", "new": "x"})
        assert first + tokens["old"] == want["all"] and tokens["new"] == want["qv"]
        assert list(engine.model.lora_adapters) == [engine._adapter_keys["x"]] and engine.served_adapters() == ["x"]
        engine.load_adapter("y", str(adapters["rslora"]))  # x, unused, leaves memory: one adapter at most
        assert list(engine.model.lora_adapters) == ["y"]
        engine.add_request("again", prompt, GREEDY, adapter="x")  # reloaded from its file
        assert _run(engine, {"again": "x"})["again"] == want["qv"]
        assert list(engine.model.lora_adapters) == [engine._adapter_keys["x"]]
        with pytest.raises(AdapterError, match="has already been loaded"):
            engine.load_adapter("y", str(adapters["all"]))
    finally:
        engine.close()


def test_requests_in_flight_while_an_adapter_is_unloaded_and_loaded_again(server, adapters):
    """Each request for the name either runs wholly on one of the two adapters loaded under it in turn, or is
    refused with 404 up front; none fails."""
    prompt = list(range(300, 340))
    want = {completion(server, name, prompt, 16)[0] for name in ("all", "qv")}
    assert len(want) == 2
    load(server, "turns", adapters["all"]).raise_for_status()

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:
            async def ask(i):
                await asyncio.sleep(0.01 * i)
                r = await client.post("/v1/completions", json={"model": "turns", "prompt": prompt, "max_tokens": 16,
                                                                "temperature": 0, "ignore_eos": True})
                return r.status_code, r.json()

            async def take_turns():
                for i in range(8):
                    (await client.post("/v1/unload_lora_adapter", json={"lora_name": "turns"}, headers=AUTH)
                     ).raise_for_status()
                    (await client.post("/v1/load_lora_adapter", headers=AUTH, json={
                        "lora_name": "turns", "lora_path": str(adapters["qv" if i % 2 == 0 else "all"])})
                     ).raise_for_status()
                    await asyncio.sleep(0.05)

            *answers, _ = await asyncio.gather(*(ask(i) for i in range(40)), take_turns())
            return answers

    answers = asyncio.run(main())
    for status, body in answers:
        assert status in (200, 404), body
        if status == 200:
            assert body["choices"][0]["text"] in want
        else:
            assert body["error"]["code"] == "model_not_found"
    assert any(status == 200 for status, _ in answers)
    unload(server, "turns").raise_for_status()


# -- data and tensor parallelism ---------------------------------------------------------------------------

PROMPTS = [[(37 * i + 11 * j) % 4000 + 5 for j in range(40)] for i in range(8)]  # distinct first blocks


def test_requests_for_an_adapter_go_to_the_cores_that_serve_it():
    client = EngineClient(["ipc://core-0", "ipc://core-1"], "test", FrontendMetrics(CollectorRegistry()))
    try:
        for core, adapters in zip(client.cores, (["a"], ["a", "b"])):
            core.info = EngineInfo("base", "dir", 512, 4096, 1024, adapters)
        assert {client._route(p, "b").index for p in PROMPTS} == {1}  # core 0 is still loading it, say
        assert {client._route(p, "a").index for p in PROMPTS} == {0, 1}
        assert client.served_models() == ["base", "a", "b"]
    finally:
        client.context.term()


def _outputs(url: str, models: list[str]) -> dict:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def one(model, prompt):
                r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                                "temperature": 0, "ignore_eos": True, "logprobs": 0})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                return choice["text"], choice["logprobs"]["token_logprobs"]

            keys = [(m, i) for m in models for i in range(len(PROMPTS))]
            return dict(zip(keys, await asyncio.gather(*(one(m, PROMPTS[i]) for m, i in keys))))

    return asyncio.run(main())


def assert_same_outputs(got: dict, want: dict) -> None:
    for key, (text, logprobs) in want.items():
        assert got[key][0] == text and got[key][1] == pytest.approx(logprobs, abs=TOLERANCE), key


def test_every_core_serves_every_adapter(server, tiny, adapters, tmp_path):
    """Two engine cores: an adapter of lora_modules, one loaded by the API and a fine-tuning job's (trained on core
    0) each give the outputs of one core, from both cores."""
    want = _outputs(server, ["all", "qv"])
    modules = json.dumps([f"start={adapters['all']}"])
    with service_process(model=str(tiny), dtype="float32", data_parallel_size=2, api_server_count=1,
                         lora_modules=modules) as service:
        url = service.url
        assert load(url, "qv", adapters["qv"]).status_code == 200
        before = scrape(url)
        got = _outputs(url, ["start", "qv"])
        assert_same_outputs({("all" if m == "start" else m, i): v for (m, i), v in got.items()}, want)
        assert all(v > 0 for v in _moved(before, scrape(url)).values())
        job = _fine_tune(url)
        assert job["status"] == "succeeded", job
        # core 1 loads the job's adapter when the front-end tells it: soon after the job succeeds
        for _ in range(50):
            before = scrape(url)
            _outputs(url, [job["fine_tuned_model"]])
            if all(v > 0 for v in _moved(before, scrape(url)).values()):
                break
        else:
            pytest.fail("one core never served the fine-tuned adapter")


def _moved(before: dict, after: dict) -> dict[str, float]:
    """Prompt tokens each engine core looked up in its prefix cache: what it served."""
    def per_core(metrics):
        return {dict(labels)["engine"]: v for (name, labels), v in metrics.items()
                if name == "llm_prefix_cache_queried_tokens_total"}
    old, new = per_core(before), per_core(after)
    assert set(new) == {"0", "1"}
    return {core: new[core] - old.get(core, 0) for core in new}


def _fine_tune(url: str) -> dict:
    lines = [json.dumps({"prompt": f"Fortune {i}:", "completion": " the sea is calm today"}) for i in range(8)]
    # the first upload starts the front-end's tokenizing process: slow on a busy machine
    upload = httpx.post(f"{url}/v1/files", data={"purpose": "fine-tune"}, timeout=120,
                        files={"file": ("sea.jsonl", "\n".join(lines).encode())}).json()
    job = httpx.post(f"{url}/v1/fine_tuning/jobs", timeout=120, json={
        "model": base_model(url), "training_file": upload["id"], "seed": 3,
        "hyperparameters": {"n_epochs": 5, "batch_size": 4, "learning_rate_multiplier": 5},
        "extra": {"lora_rank": 4}}).json()
    for _ in range(1200):
        job = httpx.get(f"{url}/v1/fine_tuning/jobs/{job['id']}", timeout=60).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    return job


def test_every_rank_holds_its_slices_of_the_adapters(server, tiny, adapters):
    want = _outputs(server, ["all", "qv"])
    modules = json.dumps([f"start={adapters['all']}"])
    with service_process(model=str(tiny), dtype="float32", tensor_parallel_size=2, lora_modules=modules) as service:
        url = service.url
        assert load(url, "qv", adapters["qv"]).status_code == 200
        got = _outputs(url, ["start", "qv"])
        assert_same_outputs({("all" if m == "start" else m, i): v for (m, i), v in got.items()}, want)
        # unloaded and loaded again from another file: the worker follows
        assert unload(url, "qv").status_code == 200 and load(url, "qv", adapters["all"]).status_code == 200
        assert_same_outputs(_outputs(url, ["qv"]), {("qv", i): want["all", i] for i in range(len(PROMPTS))})


def test_a_lora_module_that_cannot_be_served_stops_the_start(tiny, tmp_path):
    """The engine core (a thread here) ends before it binds its socket; the launcher then stops the service."""
    settings = Settings(model=str(tiny), device="cpu", lora_modules=[f"bad={tmp_path / 'nowhere'}"])
    with pytest.raises(RuntimeError, match=r"lora_modules: cannot serve 'bad=.*': No adapter found for"):
        EngineCore(settings, f"ipc://{tmp_path / 'core.sock'}")
