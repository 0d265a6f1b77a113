"""A tensor-parallel worker reads LoRA adapter files on a thread of its own (ModelRunner._apply_adapter_changes):
a step that does not use an announced adapter runs without waiting for its file, a step that uses one waits for it,
and a name rank 0 changed or stopped serving never serves its old version. Adapters loaded while streams run make
on two ranks the tokens one rank makes: served from slots, through the hooks, and read again after max_cpu_loras let
them go."""
import threading
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from service.engine.llm import LLM
from service.engine.model_runner import EAGER, ModelRunner, StepPlan
from service.model import peft
from service.model.loader import load_model
from service.model.lora import Adapter, LoRAConfig, has_adapter
from service.model.parallel import TensorParallel
from service.protocol import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def adapter_files(model_dir, tmp_path_factory) -> list[Path]:
    """Two adapters of every projection, B random so that each changes the output."""
    model = load_model(model_dir, torch.float32, "cpu")
    files = []
    for seed in (1, 2):
        adapter = Adapter.init(model, LoRAConfig(rank=4, alpha=64.0), seed=seed)
        for name, (_, b) in adapter.weights.items():
            b.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed * 1000 + len(name)))
        files.append(tmp_path_factory.mktemp("adapters") / f"adapter-{seed}.safetensors")
        adapter.save(files[-1])
    return files


def plan(adapters: list[str | None] | None = None, loads: list[tuple[int, str]] = ()) -> StepPlan:
    return StepPlan(EAGER, (0, 0), 0, 0, 0, 0, [], None, adapters=adapters, lora_loads=list(loads))


def test_a_worker_reads_adapter_files_off_the_step_path(model_dir, adapter_files, monkeypatch):
    """Rank 1's runner: reads are held until released, so each step's wait (or not) shows."""
    model = load_model(model_dir, torch.float32, "cpu", TensorParallel(1, 2))
    runner = ModelRunner(model, 16, 256, 4, 64)
    gates = {str(path): threading.Event() for path in adapter_files}
    read = peft.load_adapter

    def held_read(path, device, dtype):
        assert threading.current_thread() is not threading.main_thread()
        gates[str(path)].wait(10)  # a step that waited wrongly installs it: the test fails, not hangs
        return read(path, device, dtype)

    monkeypatch.setattr(peft, "load_adapter", held_read)
    first, second = map(str, adapter_files)
    runner._apply_adapter_changes({"a": first, "b": second})  # returns with both reads held
    runner._install_adapter_reads(plan([None]))  # a step that uses neither does not wait
    assert not has_adapter(model, "a") and not has_adapter(model, "b")

    threading.Timer(0.2, gates[first].set).start()
    runner._install_adapter_reads(plan(["a", None]))  # the hooks serve "a": the step waits for it
    assert has_adapter(model, "a") and not has_adapter(model, "b")
    whole = Adapter.load(first, "cpu", torch.float32)
    for name, tensors in whole.shard(model.config, model.tp).weights.items():  # this rank's slices
        assert all(torch.equal(x, y) for x, y in zip(model.lora_adapters["a"].weights[name], tensors))

    runner._apply_adapter_changes({"a": second, "b": None})  # "a" now names the second file; "b" goes unread
    assert not has_adapter(model, "a")  # no step serves its old version meanwhile
    gates[second].set()
    runner._install_adapter_reads(plan(loads=[(0, "a")]))  # a slot load of "a" waits for it
    assert model.lora_adapters["a"].source == second and not has_adapter(model, "b")
    assert not runner._adapter_reads


def generate(model_dir: Path, adapter_files: list[Path], tp: int, **settings) -> dict[str, list[int]]:
    """Adapters loaded while base requests stream, then requests for them, step by step."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp, max_num_batched_tokens=32,
              async_scheduling=True, **settings)
    engine = llm.engine
    tokens: dict[str, list[int]] = {}

    def step(times: int | None = None) -> None:
        while engine.has_work and (times is None or times > 0):
            for out in engine.step()[0]:
                tokens.setdefault(out.request_id, []).append(out.token_id)
            times = None if times is None else times - 1

    try:
        engine.add_request("base", [11, 12, 13], GREEDY)
        engine.add_request("base-long", list(range(100, 140)), GREEDY)
        step(2)
        engine.load_adapter("a", str(adapter_files[0]))
        engine.load_adapter("b", str(adapter_files[1]))
        step(2)  # these steps announce the adapters and use neither
        engine.add_request("a", [11, 12, 13], GREEDY, adapter="a")
        engine.add_request("b", [11, 12, 13], GREEDY, adapter="b")
        engine.add_request("a-sampled", list(range(200, 230)), SAMPLED, adapter="a")
        step()
        return tokens
    finally:
        engine.close()


@pytest.mark.parametrize("settings", [{}, {"max_loras": 0}, {"max_cpu_loras": 1}],
                         ids=["slots", "hooks", "read-again"])
def test_adapters_loaded_while_streams_run_make_the_tokens_one_rank_makes(model_dir, adapter_files, settings):
    one = generate(model_dir, adapter_files, 1, **settings)
    assert one["a"] != one["base"] and one["b"] != one["base"] and one["a"] != one["b"]
    assert generate(model_dir, adapter_files, 2, **settings) == one
