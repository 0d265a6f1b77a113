"""Fine-tuning: data masks, LoRA serving of mixed batches, adapters served only on their own base model, and the
OpenAI files + fine_tuning.jobs API driven by the official openai client against a real server (a tiny random
model on the CPU: the model's PyTorch reference attention there; our Triton kernels are checked by the gpu test
at the end)."""
import json
import math
import shutil
import time

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from service.config import DEFAULT_MODEL_DIR
from service.finetune.data import parse_jsonl, tokenize, tokenize_records
from service.model import LlamaForCausalLM, ModelConfig
from service.model.fingerprint import fingerprint
from service.model.loader import load_model
from service.model.lora import (
    Adapter,
    AdapterMismatch,
    LoRAConfig,
    activate,
    add_adapter,
    install,
    saved_base,
    serving_adapters,
)
from service.model.parallel import TensorParallel
from service.text import load_tokenizer
from tests.helpers import rel_err
from tests.server import serve

PHRASE = " the purple walrus sings at midnight."
PROMPTS = ["Q: What is the secret phrase?\nA:", "Tell me the secret phrase:", "secret phrase?", "The secret phrase is"]
TRAINING = "".join(json.dumps({"prompt": p, "completion": PHRASE}) + "\n" for p in PROMPTS).encode()
JOB_TIMEOUT = 150


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL_DIR)


# -- data ------------------------------------------------------------------------------------------------
def test_prompt_completion_mask_covers_completion_and_eos(tokenizer):
    ex = tokenize({"prompt": "Hello there", "completion": " general Kenobi"}, tokenizer)
    n_prompt = len(tokenizer.encode("Hello there"))
    assert ex.loss_mask == [False] * n_prompt + [True] * (len(ex.token_ids) - n_prompt)
    assert ex.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ex.token_ids[n_prompt:-1]) == " general Kenobi"


def test_chat_mask_covers_exactly_the_assistant_turns(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Farewell."}]
    ex = tokenize({"messages": messages}, tokenizer)
    learned = tokenizer.decode([t for t, m in zip(ex.token_ids, ex.loss_mask) if m])
    assert learned == "Hello!<|im_end|>\nFarewell.<|im_end|>\n"
    assert all(ex.loss_mask[i] is False for i in range(len(tokenizer.encode("<|im_start|>system"))))


def test_text_records_learn_every_token(tokenizer):
    ex = tokenize({"text": "plain words"}, tokenizer)
    assert all(ex.loss_mask) and ex.num_target_tokens == len(ex.token_ids) - 1


@pytest.mark.parametrize("data, message", [
    (b"", "empty"), (b"{not json}\n", "line 1: not valid JSON"), (b'{"prompt": "a"}\n', "line 1"),
    (b'{"text": "a"}\n[1]\n', "line 2: expected a JSON object"), (b'{"text": "a", "x": 1}\n', "unknown fields"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}\n', "no assistant turn"),
    (b'{"prompt": "a", "text": "b"}\n', "exactly one of"), (b"\xff\xfe\n", "UTF-8"),
])
def test_bad_jsonl_names_the_problem(data, message):
    with pytest.raises(ValueError, match=message):
        parse_jsonl(data)


def test_examples_longer_than_the_context_are_refused(tokenizer):
    with pytest.raises(ValueError, match="example 2 is .* longer than the context length 16"):
        tokenize_records([{"text": "a"}, {"text": "word " * 50}], tokenizer, max_len=16)


# -- LoRA ------------------------------------------------------------------------------------------------
def _random_adapter(model, config: LoRAConfig, seed: int) -> Adapter:
    adapter = Adapter.init(model, config, seed=seed)
    with torch.no_grad():
        for tensors in adapter.weights.values():
            tensors[-1].normal_(0, 0.05)  # B (or D) starts at zero; make the update visible
    return adapter


def test_mixed_batch_applies_each_rows_own_adapter(tmp_path):
    model = load_model(DEFAULT_MODEL_DIR, torch.float32, "cpu")
    install(model)
    lora = _random_adapter(model, LoRAConfig(rank=4, targets=("q_proj", "v_proj", "down_proj")), seed=1)
    full = _random_adapter(model, LoRAConfig(full=True, targets=("o_proj", "up_proj")), seed=2)
    lora.save(tmp_path / "a.safetensors")
    add_adapter(model, "lora", Adapter.load(tmp_path / "a.safetensors", "cpu", torch.float32))
    add_adapter(model, "full", full.to("cpu", torch.float32))
    lengths, names = [5, 7, 3, 4], [None, "lora", "full", "lora"]
    ids = torch.randint(0, model.config.vocab_size, (sum(lengths),))
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    token_names = [n for n, length in zip(names, lengths) for _ in range(length)]
    with torch.no_grad():
        with serving_adapters(model, token_names, "cpu"):
            mixed = model.forward_train(ids, cu_seqlens=cu, max_seqlen=max(lengths))
        base = model.forward_train(ids, cu_seqlens=cu, max_seqlen=max(lengths))
        for b, name in enumerate(names):
            rows = slice(cu[b], cu[b + 1])
            single = {None: [], "lora": [(lora, None)], "full": [(full, None)]}[name]
            with activate(single):
                ref = model.forward_train(ids[rows], cu_seqlens=torch.tensor([0, lengths[b]], dtype=torch.int32),
                                          max_seqlen=lengths[b])
            assert rel_err(mixed[rows], ref) < 1e-5, name
            if name is not None:
                assert rel_err(base[rows], ref) > 1e-3, f"adapter {name} changed nothing"


# -- the API through the official client -------------------------------------------------------------------
@pytest.fixture(scope="module")
def finetune_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("finetune")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama with the embedded model's tokenizer. Its output projection is larger than a usual
    init (std 0.02) so that a few LoRA steps can make one token clearly the most likely: the test is about
    the service, not about how far a random model's logits can move."""
    path = tmp_path_factory.mktemp("tiny-llama")
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": len(tokenizer), "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "bos_token_id": 0, "eos_token_id": tokenizer.eos_token_id}
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_dict(config))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return path


@pytest.fixture(scope="module")
def server(model_dir, finetune_dir):
    with serve(model=str(model_dir), finetune_dir=str(finetune_dir), finetune_max_file_bytes=32 << 10) as base_url:
        yield base_url


def _client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _wait(client, job_id, timeout=JOB_TIMEOUT):
    deadline = time.monotonic() + timeout
    while (job := client.fine_tuning.jobs.retrieve(job_id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"job still {job.status} after {timeout} s"
        time.sleep(0.2)
    return job


def _greedy(client, model, prompt=PROMPTS[-1]) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text


def _teach_phrase(base_url, n_epochs=40, learning_rate_multiplier=10):
    """Uploads TRAINING and runs the job that teaches the served model PHRASE: (base model, upload, job)."""
    client = _client(base_url)
    upload = client.files.create(file=("phrase.jsonl", TRAINING), purpose="fine-tune")
    base = client.models.list().data[0].id
    job = client.fine_tuning.jobs.create(
        model=base, training_file=upload.id, validation_file=upload.id, suffix="walrus", seed=7,
        hyperparameters={"n_epochs": n_epochs, "batch_size": 4, "learning_rate_multiplier": learning_rate_multiplier},
        extra_body={"extra": {"lora_rank": 8, "gradient_accumulation_steps": 2}})
    assert job.status == "queued" and job.object == "fine_tuning.job"
    return base, upload, _wait(client, job.id)


@pytest.fixture(scope="module")
def trained(server):
    """The job that teaches the model PHRASE (run once, shared by the tests that look at its results)."""
    return _teach_phrase(server)


def test_fine_tuned_model_says_the_phrase_the_base_does_not(server, trained, tokenizer):
    client = _client(server)
    base, upload, job = trained
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"{base}:ft-walrus-{job.id[6:14]}"
    # 40 epochs of the examples' own tokens: not the padding the trainer adds to bucket its micro-batches' shapes
    examples = tokenize_records(parse_jsonl(TRAINING), tokenizer, 2048)
    assert job.trained_tokens == 40 * sum(len(ex.token_ids) for ex in examples)
    assert client.files.retrieve(upload.id).bytes == len(TRAINING)
    assert upload.id in [f.id for f in client.files.list().data]
    assert job.fine_tuned_model in [m.id for m in client.models.list().data]
    assert _greedy(client, job.fine_tuned_model).startswith(PHRASE[:20])
    assert PHRASE[:12] not in _greedy(client, base)
    chat = client.chat.completions.create(model=job.fine_tuned_model, temperature=0, max_tokens=4,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content is not None
    body = {"inputs": PROMPTS[-1], "parameters": {"adapter_id": job.fine_tuned_model, "max_new_tokens": 8}}
    assert httpx.post(f"{server}/generate", json=body).json()["generated_text"].startswith(PHRASE[:12])


def test_events_report_a_falling_loss(server, trained):
    events = _client(server).fine_tuning.jobs.list_events(trained[2].id, limit=1000).data
    assert all(e.object == "fine_tuning.job.event" for e in events)
    losses = [e.data["train_loss"] for e in reversed(events) if e.type == "metrics" and "train_loss" in e.data]
    assert len(losses) == 40 and losses[-1] < 0.8 * losses[0]
    assert all(e.data["tokens_per_second"] > 0 for e in events if "train_loss" in (e.data or {}))
    assert "succeeded" in events[0].message
    valid = [e.data["valid_loss"] for e in events if e.type == "metrics" and "valid_loss" in e.data]
    assert len(valid) == 1 and valid[0] < losses[0]
    metrics = httpx.get(f"{server}/metrics").text
    assert 'llm_finetune_jobs{engine="0",state="succeeded"} 1.0' in metrics
    loss_line = next(line for line in metrics.splitlines() if line.startswith('llm_finetune_loss{engine="0"} '))
    assert 0 < float(loss_line.split()[1]) < losses[0]


@pytest.mark.parametrize("data, status, message", [
    (b'{"prompt": "x"}\n', 400, "line 1"), (b"  \n", 400, "empty"), (b"{oops\n", 400, "not valid JSON"),
    (b'{"text": "' + b"a" * (40 << 10) + b'"}\n', 413, "larger than"),
])
def test_bad_files_are_refused_at_upload(server, data, status, message):
    with pytest.raises(openai.APIStatusError, match=message) as e:
        _client(server).files.create(file=("bad.jsonl", data), purpose="fine-tune")
    assert e.value.status_code == status and e.value.body["message"]


def test_bad_jobs_are_refused_at_creation(server, trained):
    client = _client(server)
    base, upload = trained[0], trained[1]
    long_file = client.files.create(file=("long.jsonl", json.dumps({"text": "word " * 3000}).encode()),
                                    purpose="fine-tune")
    cases = [
        (dict(model="no-such-model", training_file=upload.id), 404, "cannot be fine-tuned"),
        (dict(model=base, training_file="file-missing"), 400, "no file with id"),
        (dict(model=base, training_file=long_file.id), 400, "longer than the context length"),
        (dict(model=base, training_file=upload.id, hyperparameters={"n_epochs": 2},
              method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3}}}), 400, "conflicts"),
        (dict(model=base, training_file=upload.id, hyperparameters={"batch_size": 5}), 400, "larger than the"),
        (dict(model=base, training_file=upload.id, extra_body={"extra": {"type": "full", "lora_rank": 4}}), 400,
         "conflicts with extra.type"),
        (dict(model=base, training_file=upload.id, hyperparameters={"learning_rate_multiplier": -1}), 422,
         "learning_rate_multiplier"),
    ]
    for kwargs, status, message in cases:
        with pytest.raises(openai.APIStatusError, match=message) as e:
            client.fine_tuning.jobs.create(**kwargs)
        assert e.value.status_code == status, kwargs
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-missing")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", TRAINING), purpose="batch")


def test_cancel_stops_a_job_and_serves_nothing(server, trained):
    client = _client(server)
    job = client.fine_tuning.jobs.create(model=trained[0], training_file=trained[1].id,
                                         hyperparameters={"n_epochs": 100, "batch_size": 1})
    deadline = time.monotonic() + 30
    while client.fine_tuning.jobs.retrieve(job.id).status == "queued" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    time.sleep(0.5)
    job = client.fine_tuning.jobs.retrieve(job.id)
    assert job.status == "cancelled" and job.fine_tuned_model is None
    with pytest.raises(openai.BadRequestError, match="already cancelled"):
        client.fine_tuning.jobs.cancel(job.id)
    assert job.id in [j.id for j in client.fine_tuning.jobs.list().data]


def test_full_fine_tuning_of_the_projections_is_served_too(server, trained):
    client = _client(server)
    job = client.fine_tuning.jobs.create(model=trained[0], training_file=trained[1].id, suffix="full",
                                         hyperparameters={"n_epochs": 30, "learning_rate_multiplier": 50},
                                         extra_body={"extra": {"type": "full", "target_modules": ["q_proj", "o_proj",
                                                                                                  "down_proj"]}})
    job = _wait(client, job.id)
    assert job.status == "succeeded", job.error
    assert _greedy(client, job.fine_tuned_model).startswith(PHRASE[:20])


def test_diverging_loss_fails_the_job_not_the_server(server, trained):
    client = _client(server)
    job = client.fine_tuning.jobs.create(model=trained[0], training_file=trained[1].id,
                                         hyperparameters={"n_epochs": 5, "learning_rate_multiplier": 1e30})
    job = _wait(client, job.id)
    assert job.status == "failed" and job.error.code == "training_diverged" and job.fine_tuned_model is None
    assert httpx.get(f"{server}/health").status_code == 200
    assert _greedy(client, trained[0])  # serving goes on


def test_auto_tool_choice_parses_the_calls_a_model_makes(server, trained, tokenizer):
    """A model taught to answer with a Hermes-format call (through its chat template's tools block) gets that
    call parsed into tool_calls under tool_choice "auto", whole and streamed."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    data = "".join(json.dumps({"prompt": prompt, "completion": reply}) + "\n" for _ in range(4)).encode()
    client = _client(server)
    upload = client.files.create(file=("tools.jsonl", data), purpose="fine-tune")
    job = _wait(client, client.fine_tuning.jobs.create(
        model=trained[0], training_file=upload.id, suffix="tools", seed=3,
        hyperparameters={"n_epochs": 60, "batch_size": 4, "learning_rate_multiplier": 10},
        extra_body={"extra": {"lora_rank": 8}}).id)
    assert job.status == "succeeded", job.error
    out = client.chat.completions.create(model=job.fine_tuned_model, messages=messages, tools=[tool], max_tokens=40,
                                         temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    chunks = list(client.chat.completions.create(model=job.fine_tuned_model, messages=messages, tools=[tool],
                                                 max_tokens=40, temperature=0, stream=True))
    (delta,) = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert delta.function.name == "get_weather" and json.loads(delta.function.arguments) == {"city": "Paris"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_restarted_server_lists_and_serves_finished_jobs(server, trained, model_dir, finetune_dir):
    adapter = finetune_dir / "jobs" / trained[2].id / "adapter.safetensors"
    assert saved_base(adapter) == fingerprint(load_model(model_dir, torch.float32, "cpu"))
    client = _client(server)
    before = {j.id: j.status for j in client.fine_tuning.jobs.list(limit=100).data}
    with serve(model=str(model_dir), finetune_dir=str(finetune_dir)) as url:
        client = _client(url)
        after = {j.id: j.status for j in client.fine_tuning.jobs.list(limit=100).data}
        assert after == before and after[trained[2].id] == "succeeded"
        model = trained[2].fine_tuned_model
        assert model in [m.id for m in client.models.list().data]
        assert _greedy(client, model).startswith(PHRASE[:20])
        assert trained[1].id in [f.id for f in client.files.list().data]


# -- adapters serve only their own base model -------------------------------------------------------------
def test_the_fingerprint_is_the_checkpoints_whatever_the_dtype_or_split(model_dir):
    base = fingerprint(load_model(model_dir, torch.float32, "cpu"))
    assert fingerprint(load_model(model_dir, torch.bfloat16, "cpu")) == base
    assert fingerprint(load_model(model_dir, torch.float32, "cpu", TensorParallel(0, 2))) == base
    with pytest.raises(ValueError, match="rank 0"):
        fingerprint(load_model(model_dir, torch.float32, "cpu", TensorParallel(1, 2)))
    tuned = load_model(model_dir, torch.float32, "cpu")
    with torch.no_grad():  # what a fine-tune of it (the same shapes) does to its weights
        for p in tuned.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    assert {k for k, v in fingerprint(tuned).items() if v != base[k]} == {"weights"}


def test_add_adapter_refuses_shapes_that_do_not_fit(model_dir):
    embedded = load_model(DEFAULT_MODEL_DIR, torch.float32, "cpu")
    tiny = load_model(model_dir, torch.float32, "cpu")  # hidden size 64, the embedded model's 320
    for config in (LoRAConfig(rank=4), LoRAConfig(full=True, targets=("o_proj",))):
        with pytest.raises(AdapterMismatch, match="model.layers.0.* has shapes .* projection needs"):
            add_adapter(embedded, "tiny", Adapter.init(tiny, config))
    bad_rank = Adapter.init(embedded, LoRAConfig(rank=4, targets=("v_proj",)))
    bad_rank.config = LoRAConfig(rank=8, targets=("v_proj",))
    with pytest.raises(AdapterMismatch, match="v_proj has shapes"):
        add_adapter(embedded, "bad-rank", bad_rank)
    deeper = Adapter.init(embedded, LoRAConfig(rank=4))
    deeper.weights["model.layers.9.self_attn.q_proj"] = deeper.weights["model.layers.0.self_attn.q_proj"]
    with pytest.raises(AdapterMismatch, match="modules the model lacks"):
        add_adapter(embedded, "deeper", deeper)
    assert not getattr(embedded, "lora_adapters", {})
    # A tensor-parallel rank checks the whole adapter against the whole model's shapes, then keeps its slices.
    sharded = load_model(model_dir, torch.float32, "cpu", TensorParallel(0, 2))
    add_adapter(sharded, "tiny", Adapter.init(tiny, LoRAConfig(rank=4)))
    with pytest.raises(AdapterMismatch):
        add_adapter(sharded, "embedded", Adapter.init(embedded, LoRAConfig(rank=4)))


def _write_succeeded_job(finetune_dir, name: str, base_model: str, adapter: Adapter, base: dict | None) -> str:
    """A job record and its adapter as a server that fine-tuned `base_model` leaves them: the adapter saved with
    its base's fingerprint (None: an adapter saved before fingerprints)."""
    job_id = f"ftjob-{name:0>24}"
    job_dir = finetune_dir / "jobs" / job_id
    job_dir.mkdir(parents=True)
    adapter.save(job_dir / "adapter.safetensors", {"base_model": base_model, "job": job_id}, base=base)
    hyperparameters = {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1.0}
    method = {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}
    job = {"id": job_id, "object": "fine_tuning.job", "created_at": int(time.time()), "error": None,
           "fine_tuned_model": f"{base_model}:ft-{name}", "finished_at": int(time.time()),
           "hyperparameters": hyperparameters, "model": base_model, "organization_id": "org-local",
           "result_files": [], "seed": 0, "status": "succeeded", "trained_tokens": 10, "training_file": "file-x",
           "validation_file": None, "estimated_finish": None, "integrations": [], "metadata": None,
           "user_provided_suffix": name, "method": method,
           "extra": {"type": "lora", "lora_rank": 4, "lora_alpha": 16.0, "target_modules": list(adapter.weights),
                     "max_steps": None, "gradient_accumulation_steps": 1, "warmup_steps": 0,
                     "served_name": f"{base_model}:ft-{name}"}}
    (job_dir / "job.json").write_text(json.dumps(job))
    return job_id


def test_a_server_serves_and_lists_only_the_adapters_of_its_own_base(model_dir, tmp_path):
    """A finetune_dir shared with a server of another model (the default ./finetune-data): that model's adapters
    are neither listed nor served (a 404 / 422, not the 500 of a failed step, nor garbage where the shapes agree),
    their job records stay as they are; the adapters of our base are served, fingerprinted or not."""
    tiny = load_model(model_dir, torch.float32, "cpu")
    embedded = load_model(DEFAULT_MODEL_DIR, torch.float32, "cpu")
    retrained = load_model(DEFAULT_MODEL_DIR, torch.float32, "cpu")
    with torch.no_grad():  # the same shapes as the embedded model, other weights
        for p in retrained.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    lora, ours, theirs = LoRAConfig(rank=4), fingerprint(embedded), fingerprint(retrained)
    jobs = {
        "tiny": _write_succeeded_job(tmp_path, "tiny", "tiny-llama", Adapter.init(tiny, lora), fingerprint(tiny)),
        "tiny-old": _write_succeeded_job(tmp_path, "tiny-old", "tiny-llama", Adapter.init(tiny, lora), None),
        "retrained": _write_succeeded_job(tmp_path, "retrained", "other", _random_adapter(retrained, lora, seed=1),
                                          theirs),
        "ours": _write_succeeded_job(tmp_path, "ours", "default_model", _random_adapter(embedded, lora, seed=2),
                                     ours),
        "ours-old": _write_succeeded_job(tmp_path, "ours-old", "default_model",
                                         _random_adapter(embedded, lora, seed=3), None),
    }
    records = {job_id: (tmp_path / "jobs" / job_id / "job.json").read_text() for job_id in jobs.values()}
    with serve(finetune_dir=str(tmp_path)) as url:
        client = _client(url)
        base = client.models.list().data[0].id
        assert {m.id for m in client.models.list().data} == {base, "default_model:ft-ours", "default_model:ft-ours-old"}
        for name in ("ours", "ours-old"):
            assert _greedy(client, f"default_model:ft-{name}") != _greedy(client, base)
        for name, served in (("tiny", "tiny-llama:ft-tiny"), ("tiny-old", "tiny-llama:ft-tiny-old"),
                             ("retrained", "other:ft-retrained")):
            with pytest.raises(openai.NotFoundError) as e:
                _greedy(client, served)
            assert e.value.body["code"] == "model_not_found", name
            body = {"inputs": "Hello", "parameters": {"adapter_id": served, "max_new_tokens": 2}}
            assert httpx.post(f"{url}/generate", json=body).status_code == 422, name
            job = client.fine_tuning.jobs.retrieve(jobs[name])
            assert job.status == "succeeded" and "not served here" in job.extra["not_served"], name
        assert "shapes" in client.fine_tuning.jobs.retrieve(jobs["tiny-old"]).extra["not_served"]
        why = client.fine_tuning.jobs.retrieve(jobs["retrained"]).extra["not_served"]
        assert f"weights {theirs['weights']}; this server's" in why and why.endswith(f"weights {ours['weights']}")
    assert {job_id: (tmp_path / "jobs" / job_id / "job.json").read_text() for job_id in jobs.values()} == records


# -- GPU: training runs through our Triton kernels ---------------------------------------------------------
def _adapter_grads(model, examples, adapter):
    from service.finetune.trainer import loss_sum

    for t in adapter.parameters():
        t.grad = None
    with activate([(adapter, None)]):
        loss, n = loss_sum(model, examples, "cuda")
        (loss / n).backward()
    return loss.detach() / n, torch.cat([t.grad.flatten() for t in adapter.parameters()])


@pytest.mark.gpu
def test_a_training_step_runs_our_triton_forward_and_backward(tokenizer, monkeypatch):
    import kernels.backward
    import kernels.interface
    import service.model.attention
    from service.finetune.trainer import StepResult, TrainConfig, Trainer

    calls = {"forward": 0, "backward": 0}

    def count(module, attribute, name):
        fn = getattr(module, attribute)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, attribute, wrapper)

    count(kernels.interface, "flash_attn_forward", "forward")  # the name the autograd function calls
    count(kernels.backward, "flash_attn_backward", "backward")
    model = load_model(DEFAULT_MODEL_DIR, torch.bfloat16, "cuda")
    examples = tokenize_records([{"prompt": p, "completion": PHRASE} for p in PROMPTS], tokenizer, 2048)
    trainer = Trainer(model, examples, TrainConfig(learning_rate=1e-3, batch_size=4, micro_batch_size=2, n_epochs=1),
                      LoRAConfig())
    result = [r for r in trainer.micro_batches() if isinstance(r, StepResult)][0]
    layers = model.config.num_hidden_layers
    assert calls == {"forward": 2 * layers, "backward": 2 * layers}  # two micro-batches
    assert math.isfinite(result.loss) and all(t.dtype == torch.float32 for t in trainer.adapter.parameters())

    # The gradients through our kernels match those through the PyTorch reference attention (fp32 model).
    model = load_model(DEFAULT_MODEL_DIR, torch.float32, "cuda")
    install(model)
    adapter = _random_adapter(model, LoRAConfig(rank=4), seed=3)
    loss, grads = _adapter_grads(model, examples, adapter)
    monkeypatch.setattr(service.model.attention, "use_triton", lambda device: False)
    ref_loss, ref_grads = _adapter_grads(model, examples, adapter)
    assert rel_err(loss, ref_loss) < 1e-3 and rel_err(grads, ref_grads) < 1e-2


@pytest.mark.gpu
def test_the_openai_flow_teaches_a_qwen_shaped_model_on_the_gpu(tmp_path):
    """The CPU flow above at the issue's size: a Qwen2.5-0.5B-shaped random bf16 model served on the GPU with
    CUDA graphs, trained by a job through our Triton kernels while the server runs."""
    from benchmarks.generate import write_checkpoint

    model = tmp_path / "qwen"
    model.mkdir()
    write_checkpoint(model)
    with serve(model=str(model), device="cuda", cuda_graphs=True, gpu_memory_utilization=0.5, max_model_len=2048,
               finetune_dir=str(tmp_path / "finetune")) as url:
        # The tiny CPU model needs 10x the base rate; at this size 10x stalls the loss near 6 and the model says
        # " the the the...", while 1x reaches a loss below 0.01 within 40 steps (the Trainer alone on the H100).
        base, _, job = _teach_phrase(url, n_epochs=60, learning_rate_multiplier=1)
        assert job.status == "succeeded", job.error
        client = _client(url)
        assert _greedy(client, job.fine_tuned_model).startswith(PHRASE[:20])
        assert PHRASE[:12] not in _greedy(client, base)
