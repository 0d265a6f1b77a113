"""The engine end to end on a tiny random Llama (CPU, fp32): batching, preemption, prefix caching and chunked
prefill never change greedy outputs; sampling, stops, aborts, errors; no KV block leaks."""
import json
import re
import time

import msgspec
import numpy as np
import pytest
import torch
from tiny_models import VOCAB, make_tiny_model

from service.config import DEFAULT_MODEL_DIR
from service.engine.llm import LLM
from service.engine.llm_engine import EngineStepError, RequestRejected
from service.engine.sampler import Sampler
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence
from service.protocol import Grammar, SamplingParams
from service.text import TextStream

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def make_llm(model_dir, **overrides):
    return LLM(str(model_dir), device="cpu", dtype="float32", **overrides)


def assert_no_leaks(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_work and not llm.engine.requests


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (40,), generator=g).tolist()  # prefix of half the prompts: cache hits
    out = []
    for i in range(32):
        n = int(torch.randint(1, 70, (1,), generator=g))
        tail = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append(shared + tail if i % 2 else tail)
    return out


def test_runner_packs_a_mixed_step_padded_to_a_graph_bucket(model_dir):
    """What a prefill graph's buffers receive for a step smaller than its bucket: padding tokens write no slot,
    padding sequences are empty, and only one-row sequences are handed to the decode kernel."""
    runner = make_llm(model_dir, num_kv_blocks=64, block_size=16).engine.runner
    # A 3-token chunk after 15 cached tokens (it crosses into its second block), a decode whose token is still
    # on the device (row 4 of the previous step's tokens), and a 2-token prompt.
    ids, lens_q, lens_k, tables = [5, 6, 7, -1, 9, 10], [3, 1, 2], [18, 9, 2], [[3, 4], [7], [1]]
    sources = np.array([-1, -1, -1, 4, -1, -1])
    flat, lens, table = runner._pack(ids, lens_q, lens_k, tables, 16, 6, sources, [2, 3, 5], num_tiles=9)
    positions = [15, 16, 17, 8, 0, 1]
    assert flat[0].tolist() == ids + [0] * 10 and flat[1].tolist() == sources.tolist() + [-1] * 10
    assert flat[2, :6].tolist() == positions
    assert flat[3].tolist() == [3 * 16 + 15, 4 * 16, 4 * 16 + 1, 7 * 16 + 8, 16, 17] + [-1] * 10
    assert flat[4, :3].tolist() == [2, 3, 5]
    assert lens.shape == (6, 12)  # 9 tiles + 1, rounded up to 16 bytes
    cu_q, cu_k, seqlens_k, single, tile_seqs, tile_rows = (row[:9].tolist() for row in lens)
    assert cu_q[:7] == [0, 3, 4, 6, 6, 6, 6] and cu_k[:7] == [0, 18, 27, 29, 29, 29, 29]
    assert seqlens_k[:6] == [18, 9, 2, 0, 0, 0] and single[:6] == [0, 9, 0, 0, 0, 0]
    # the prefill kernel's tiles: one per multi-row sequence, padded to the graph's grid
    assert tile_seqs == [0, 2] + [-1] * 7 and tile_rows[:2] == [0, 0]
    assert table.shape == (3, 16) and table[0, :2].tolist() == [3, 4] and not table[:, 2:].any()


def test_decode_block_tables_stay_on_the_device_and_follow_every_change(model_dir):
    """What _sync_tables keeps in the decode graphs' block tables: a sequence's whole table when it is new or its
    table was replaced (preempted), then only new blocks and a copy-on-write replacement of its last block."""
    runner = make_llm(model_dir, num_kv_blocks=64).engine.runner
    runner.static = {"tables": torch.full((3, 16), -7, dtype=torch.int32)}
    runner._table_rows, runner._free_table_rows = {}, [0, 1, 2]
    a, b, c = (Sequence(rid, [3, 4], GREEDY) for rid in "abc")
    ta, tb = [5, 6], [9]

    def check(seqs, tables):
        rows, updates = runner._sync_tables(seqs, tables)
        runner._update_tables(updates)
        assert len(set(rows)) == len(rows)
        for row, table in zip(rows, tables):
            assert runner.static["tables"][row, :len(table)].tolist() == table
        return rows

    first = check([a, b], [ta, tb])
    ta.append(7)  # a grows a block
    tb[-1] = 11  # b's last block copied on write
    assert check([a, b], [ta, tb]) == first
    ta = [20, 21, 22, 23]  # a preempted and readmitted: a new table
    check([a, b], [ta, tb])
    rows = check([b, c], [tb, [30, 31]])  # a leaves and frees its row; c takes one
    assert rows[0] == first[1] and len(runner._free_table_rows) == 1


@pytest.fixture(scope="module")
def alone(model_dir, prompts):
    llm = make_llm(model_dir, num_kv_blocks=64, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("settings", [
    dict(num_kv_blocks=512, max_num_batched_tokens=512),  # admitted over a few steps: prefix cache hits
    dict(num_kv_blocks=24),  # tiny cache: preemption and recomputation
    dict(num_kv_blocks=512, max_num_batched_tokens=32),  # chunked prefill
    dict(num_kv_blocks=40, max_num_batched_tokens=48, max_num_seqs=5),
    dict(num_kv_blocks=512, max_num_batched_tokens=512, max_mixed_step_tokens=24),  # prompts chunked beside decodes
], ids=["batched", "preempting", "chunked", "all-tight", "mixed-capped"])
def test_batch_matches_alone(model_dir, prompts, alone, settings, async_scheduling):
    llm = make_llm(model_dir, async_scheduling=async_scheduling, **settings)
    preemptions, hits, mixed = [], [], []
    step = llm.engine.step

    def counting_step():
        outputs, stats = step()
        if stats:
            preemptions.append(stats.num_preemptions)
            hits.append(stats.prefix_hit_tokens)
            if stats.num_decode_tokens and stats.num_prefill_tokens:
                mixed.append(stats)
        return outputs, stats

    llm.engine.step = counting_step
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    if "max_mixed_step_tokens" in settings:  # prompts took only what the decodes left of the cap
        cap = settings["max_mixed_step_tokens"]
        assert mixed and all(s.num_prefill_tokens <= cap - s.num_decode_tokens for s in mixed)
    if settings["num_kv_blocks"] < 30:
        assert sum(preemptions) > 0
    else:
        assert sum(hits) > 0
    assert_no_leaks(llm)


def test_new_requests_wait_a_few_steps_for_company_while_others_decode():
    def step(scheduler):
        batch = scheduler.schedule()
        for seq in batch.seqs:  # what a completed step does: each sampled row gains a token
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(7)
        return [s.request_id for s, prefill in zip(batch.seqs, batch.is_prefill) if prefill]

    def request(rid, tokens=10):
        return Sequence(rid, list(range(3, 3 + tokens)), SamplingParams(max_new_tokens=100))

    scheduler = Scheduler(64, 16, False, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, hold_steps=3)
    scheduler.add(request("a"))
    assert step(scheduler) == ["a"]  # nothing decodes: admitted at once
    scheduler.add(request("b"))
    assert [step(scheduler) for _ in range(3)] == [[], [], ["b"]]  # beside a decode: held for 3 steps at most
    scheduler.add(request("c"))
    assert step(scheduler) == []
    scheduler.add(request("d", 60))  # enough prompt tokens to fill the step's room: no reason to wait
    assert step(scheduler) == ["c", "d"]
    assert scheduler.running[-1].num_computed_tokens < 60  # d took what the decodes left and goes on
    scheduler = Scheduler(64, 16, False, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    scheduler.add(request("a"))
    step(scheduler)
    scheduler.add(request("b"))
    assert step(scheduler) == ["b"]  # hold_steps=0: at once


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_sampling_seeds_stops_and_lengths(model_dir, async_scheduling):
    llm = make_llm(model_dir, num_kv_blocks=128, async_scheduling=async_scheduling)
    prompt = [5, 6, 7, 8, 9]
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    first, second, other = llm.generate([prompt, prompt, prompt], [seeded, seeded,
                                        msgspec.structs.replace(seeded, seed=8)])
    assert first.token_ids == second.token_ids and first.text == second.text
    assert first.token_ids != other.token_ids
    assert len(first.token_ids) == 12 and first.finish_reason == "length"

    base = llm.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 3]
    stopped = llm.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True,
                                                   stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == base.text[:base.text.index(stop)]
    by_token = llm.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0.0,
                                                     stop_token_ids=[base.token_ids[3]]))[0]
    stop_at = base.token_ids.index(base.token_ids[3])
    assert by_token.finish_reason == "stop" and by_token.token_ids == base.token_ids[:stop_at + 1]
    eos = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = {base.token_ids[2]}
    ended = llm.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0.0))[0]
    llm.engine.eos_token_ids = eos
    assert ended.finish_reason == "eos_token" and ended.token_ids[-1] == base.token_ids[2]
    with_logprobs = llm.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0.0, logprobs=True,
                                                          top_logprobs=2))[0]
    assert with_logprobs.token_ids == base.token_ids[:3]
    assert_no_leaks(llm)


def test_first_token_reports_time_spent_waiting(model_dir):
    llm = make_llm(model_dir, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("first", [1, 2, 3], GREEDY)
    engine.add_request("second", [4, 5, 6], GREEDY)
    outputs = []
    while engine.has_work:
        outputs += engine.step()[0]
    by_request = {rid: [o for o in outputs if o.request_id == rid] for rid in ("first", "second")}
    for outs in by_request.values():
        assert outs[0].queue_seconds is not None and all(o.queue_seconds is None for o in outs[1:])
    # one sequence per step: "second" waited while all ten steps of "first" ran
    assert by_request["second"][0].queue_seconds > by_request["first"][0].queue_seconds
    assert_no_leaks(llm)


def test_rejections(model_dir):
    llm = make_llm(model_dir, num_kv_blocks=8, max_model_len=256)
    with pytest.raises(RequestRejected, match="context length"):
        llm.engine.add_request("a", [1] * 250, SamplingParams(max_new_tokens=10))
    with pytest.raises(RequestRejected, match="KV cache"):
        llm.engine.add_request("b", [1] * 100, SamplingParams(max_new_tokens=100))
    for bad in (SamplingParams(temperature=-1), SamplingParams(top_p=0), SamplingParams(max_new_tokens=0)):
        with pytest.raises(RequestRejected):
            llm.engine.add_request("c", [1, 2], bad)
    with pytest.raises(RequestRejected, match="token ids"):
        llm.engine.add_request("d", [99999], SamplingParams())
    assert_no_leaks(llm)


def test_aborts_and_ends_while_a_step_is_in_flight(model_dir):
    """Overlapped: a request aborted, or ended by EOS, while its next token is already being computed loses
    that token, and its blocks are free once the engine is idle."""
    llm = make_llm(model_dir, num_kv_blocks=64, async_scheduling=True)
    engine = llm.engine
    base = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    engine.eos_token_ids = {base[3]}
    engine.add_request("eos", [5, 6, 7], SamplingParams(max_new_tokens=10, temperature=0.0))
    engine.add_request("aborted", [5, 6, 7], GREEDY)
    engine.add_request("kept", [5, 6, 7], GREEDY)
    tokens = {"eos": [], "aborted": [], "kept": []}
    while engine.has_work:
        outputs, _ = engine.step()
        assert engine._in_flight is None or engine._in_flight.seqs  # a step is in flight between calls
        for out in outputs:
            tokens[out.request_id].append(out.token_id)
        if len(tokens["aborted"]) == 2 and "aborted" in engine.requests:
            assert engine.abort("aborted")
    assert tokens["eos"] == base[:4] and tokens["aborted"] == base[:2] and tokens["kept"] == base
    assert_no_leaks(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_a_failing_step_fails_its_requests_only(model_dir, async_scheduling):
    llm = make_llm(model_dir, num_kv_blocks=64, async_scheduling=async_scheduling)
    engine = llm.engine
    run = engine.runner.run

    def fail_once(batch, pending):
        engine.runner.run = run
        raise RuntimeError("injected fault")
    engine.runner.run = fail_once
    with pytest.raises(EngineStepError, match="failed to compute"):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY)
    for rid in list(engine.requests):  # generate() raised on the first error: drop what it left
        engine.abort(rid)
    while engine.has_work:
        engine.step()
    assert [o.token_ids for o in llm.generate([[5, 6, 7]], GREEDY)] == [llm.generate([[5, 6, 7]], GREEDY)[0].token_ids]
    assert_no_leaks(llm)


def test_sampler_filters():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = logits.argmax(-1).tolist()
    sampler = Sampler()
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(temperature=0.0)):
        tokens, _, _ = sampler(logits.clone(), [p] * 3, [None] * 3).fetch()
        assert tokens == greedy
    tokens, logprobs, tops = sampler(logits.clone(), [SamplingParams(temperature=0.0, logprobs=True,
                                                                     top_logprobs=3)] * 3, [None] * 3).fetch()
    expected = logits.log_softmax(-1)
    assert logprobs == pytest.approx(expected.max(-1).values.tolist(), abs=1e-5)
    assert [t[0][0] for t in tops] == greedy and len(tops[0]) == 3
    # the sampled token's logprob alone (TGI asks for it with every token), under top-k: floored where masked
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=0.5, top_k=2, logprobs=True)]
    tokens, logprobs, tops = sampler(logits[:2].clone(), params, [None] * 2).fetch()
    scaled = (logits[1] / 0.5).masked_fill(logits[1] < logits[1].topk(2).values[-1], float("-inf"))
    assert tops is None and tokens[0] == greedy[0] and tokens[1] in logits[1].topk(2).indices.tolist()
    assert logprobs == pytest.approx([expected[0].max().item(), scaled.log_softmax(-1)[tokens[1]].item()], abs=1e-5)
    # greedy rows that ask only for the token's logprob (TGI's default) take the one-pass argmax path, in bf16 too
    for dtype in (torch.float32, torch.bfloat16):
        rows = logits.to(dtype)
        tokens, logprobs, tops = sampler(rows.clone(), [SamplingParams(temperature=0.0, logprobs=True)] * 3,
                                         [None] * 3).fetch()
        assert tokens == rows.float().argmax(-1).tolist() and tops is None
        assert logprobs == pytest.approx(rows.double().log_softmax(-1).max(-1).values.tolist(), abs=1e-5)
    # as a decode graph hands them over, computed
    computed = (torch.tensor([4, 5, 6]), torch.tensor([-0.5, -1.5, -2.5]))
    assert sampler.argmax(logits, True, computed).fetch()[:2] == ([4, 5, 6], [-0.5, -1.5, -2.5])
    assert sampler.argmax(logits, False, computed).fetch()[:2] == ([4, 5, 6], None)
    # a strong repetition penalty moves greedy off a token already seen
    penalized = sampler(logits.clone(), [SamplingParams(temperature=0.0, repetition_penalty=1e6)] * 3,
                        [None] * 3, [[g] for g in greedy]).fetch()[0]
    assert all(a != b for a, b in zip(penalized, greedy))


def test_sampler_penalties_bias_bans_and_min_p():
    """OpenAI's controls as vLLM applies them, against what they must do to a greedy choice or a draw."""
    sampler = Sampler()
    logits = torch.zeros(2, 10)
    logits[:, 5], logits[:, 6] = 3.0, 2.0  # 5 leads 6 by 1.0
    seen, prompt_lens = [[5, 1, 5, 5], [5, 1, 5, 5]], [1, 1]  # row outputs: 1, 5, 5 (the prompt's 5 is not counted)

    def greedy(**controls):
        params = [SamplingParams(temperature=0.0, **controls)] * 2
        return sampler(logits.clone(), params, [None] * 2, seen, prompt_lens).fetch()[0][0]

    assert greedy() == 5
    assert greedy(frequency_penalty=0.4) == 5 and greedy(frequency_penalty=0.6) == 6  # twice: 0.8 < 1 < 1.2
    assert greedy(presence_penalty=0.9) == 5 and greedy(presence_penalty=1.1) == 6  # once, however many times
    assert greedy(frequency_penalty=-1.0) == 5
    assert greedy(logit_bias={2: 3.5}) == 2 and greedy(logit_bias={5: -1.5}) == 6
    banned = sampler(logits.clone(), [SamplingParams(temperature=0.0)] * 2, [None] * 2, banned=[[5], []]).fetch()[0]
    assert banned == [6, 5]
    # min_p: p(5) = 0.57, p(6) = 0.21 = 0.37 p(5), the others 0.03 = 0.05 p(5) each
    draws = {}
    for min_p in (0.4, 0.1):
        params = [SamplingParams(temperature=1.0, min_p=min_p)] * 2
        draws[min_p] = {t for _ in range(200) for t in sampler(logits.clone(), params, [None] * 2).fetch()[0]}
    assert draws[0.4] == {5} and draws[0.1] == {5, 6}


def test_min_tokens_holds_back_eos_and_stop_tokens(model_dir):
    llm = make_llm(model_dir, num_kv_blocks=64)
    first = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    stop_at_first = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[first[0]])
    assert llm.generate([[5, 6, 7]], stop_at_first)[0].token_ids == [first[0]]
    held = msgspec.structs.replace(stop_at_first, min_tokens=4)
    out = llm.generate([[5, 6, 7]], held)[0]
    assert len(out.token_ids) >= 4 and first[0] not in out.token_ids[:3] and out.token_ids[0] != first[0]
    assert_no_leaks(llm)


PERSON = {"type": "object", "required": ["name", "age", "tags", "home"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    "home": {"type": "object", "required": ["zip"],
             "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_grammars_bind_their_rows_and_leave_the_others_free(model_dir, prompts, alone, async_scheduling):
    """A random model's output matches each request's JSON schema or regex (and ends there, with EOS), whatever
    the batch holds; free requests beside them keep their greedy tokens, with or without overlapped steps (where
    the masks are filled while the next forward pass runs)."""
    import jsonschema

    llm = make_llm(model_dir, async_scheduling=async_scheduling, num_kv_blocks=256)
    person = Grammar("json", json.dumps(PERSON))
    json_params = SamplingParams(max_new_tokens=120, temperature=1.0, seed=5, grammar=person)
    regex_params = SamplingParams(max_new_tokens=30, temperature=0.0, grammar=Grammar("regex", r"[a-z]{2,5}-\d{3}"))
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    any_json = SamplingParams(max_new_tokens=120, temperature=0.0, grammar=Grammar("json", json.dumps(flag)))
    batch = [prompts[0], prompts[1], prompts[2], prompts[3], prompts[4]]
    outs = llm.generate(batch, [json_params, GREEDY, regex_params, GREEDY, any_json])
    # The text without the prompt's context: random prompt tokens can end inside a UTF-8 character.
    texts = [llm.tokenizer.decode(o.token_ids[:-1]) for o in outs]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    assert re.fullmatch(r"[a-z]{2,5}-\d{3}", texts[2]), texts[2]
    jsonschema.validate(json.loads(texts[4]), flag)
    assert [o.finish_reason for o in outs] == ["eos_token", "length", "eos_token", "length", "eos_token"]
    assert outs[1].token_ids == alone[1] and outs[3].token_ids == alone[3]
    with pytest.raises(RequestRejected, match="grammar: .*Unsupported type"):
        llm.generate(prompts[0], SamplingParams(grammar=Grammar("json", '{"type": "bogus"}')))
    assert_no_leaks(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_n_completions_share_the_prompt_and_draw_with_their_own_seeds(model_dir, prompts, async_scheduling):
    """n completions compute the prompt once (their KV is forked from it), greedy ones equal the single greedy
    completion, and sampled completion i equals a single request with seed + i."""
    llm = make_llm(model_dir, async_scheduling=async_scheduling, num_kv_blocks=128, enable_prefix_caching=False)
    prompt = prompts[5]
    prefill = []
    step = llm.engine.step

    def counting_step():
        outputs, stats = step()
        prefill.append(stats.num_prefill_tokens if stats else 0)
        return outputs, stats

    llm.engine.step = counting_step
    greedy = llm.generate(prompt, msgspec.structs.replace(GREEDY, n=3))
    assert sum(prefill) == len(prompt) and [o.index for o in greedy] == [0, 1, 2]
    single = llm.generate(prompt, GREEDY)[0].token_ids
    assert all(o.token_ids == single for o in greedy)
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    many = [o.token_ids for o in llm.generate(prompt, msgspec.structs.replace(sampled, n=4))]
    assert many == [llm.generate(prompt, msgspec.structs.replace(sampled, seed=11 + i))[0].token_ids
                    for i in range(4)]
    assert len({tuple(t) for t in many}) == 4
    with pytest.raises(RequestRejected, match="n must be"):
        llm.generate(prompt, msgspec.structs.replace(GREEDY, n=1000))
    assert_no_leaks(llm)


def test_aborting_the_first_completion_lets_the_others_run(model_dir, prompts):
    """Completions wait on the first one's prompt; aborting it before then sends them on alone."""
    llm = make_llm(model_dir, num_kv_blocks=128, max_num_batched_tokens=16)  # a chunked prompt: forks wait
    engine = llm.engine
    engine.add_request("r", prompts[5], msgspec.structs.replace(GREEDY, n=3))
    engine.step()
    engine.abort("r")
    done = {}
    while engine.has_work:
        for out in engine.step()[0]:
            done.setdefault(out.request_id, []).append(out.token_id)
    assert sorted(done) == ["r#1", "r#2"] and all(len(t) == GREEDY.max_new_tokens for t in done.values())
    assert_no_leaks(llm)


def test_detokenizer_utf8_and_stop_holdback(model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = "héllo 世界, def f(x): return x"
    ids = tok.encode(text)
    detok = TextStream(tok, [1], [])
    pieces = [detok.add(t)[0] for t in ids]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)

    def until_stop(detok):
        out = ""
        for t in ids:
            piece, hit = detok.add(t)
            out += piece
            if hit:
                return out
        raise AssertionError("the stop string was never hit")

    stop_at = text.index("f(x")
    assert until_stop(TextStream(tok, [1], ["f(x"])) == text[:stop_at]
    assert until_stop(TextStream(tok, [1], ["f(x"], include_stop=True)) == text[:stop_at + 3]  # TGI


def test_adapters_are_served_per_request(model_dir):
    from service.model.lora import Adapter, LoRAConfig, add_adapter

    adapter = None

    def engine_with_adapter(**settings):
        nonlocal adapter
        llm = make_llm(model_dir, num_kv_blocks=128, **settings)
        if adapter is None:
            adapter = Adapter.init(llm.engine.model, LoRAConfig(rank=4), seed=0)
            for a, b in adapter.weights.values():
                b.data.normal_(0, 0.5)
        add_adapter(llm.engine.model, "tuned", adapter.to("cpu", torch.float32))
        return llm

    prompt = list(range(3, 40))  # two full blocks: a prefix-cache hit if adapters shared cache entries

    def run(engine, requests):
        for rid, adapter_name in requests:
            engine.add_request(rid, prompt, GREEDY, adapter=adapter_name)
        tokens = {rid: [] for rid, _ in requests}
        while engine.has_work:
            for out in engine.step()[0]:
                tokens[out.request_id].append(out.token_id)
        return tokens

    ref = engine_with_adapter(enable_prefix_caching=False).engine
    base, tuned = run(ref, [("b", None)])["b"], run(ref, [("t", "tuned")])["t"]
    assert tuned != base
    llm = engine_with_adapter()
    engine = llm.engine
    assert run(engine, [("b0", None)])["b0"] == base
    assert run(engine, [("t0", "tuned")])["t0"] == tuned
    mixed = run(engine, [("b1", None), ("t1", "tuned"), ("b2", None), ("t2", "tuned")])
    assert mixed == {"b1": base, "t1": tuned, "b2": base, "t2": tuned}
    with pytest.raises(RequestRejected, match="unknown adapter"):
        engine.add_request("u", prompt, GREEDY, adapter="nope")
    assert_no_leaks(llm)


def test_default_model_is_trained_and_generates():
    """The embedded model (trained on the fortune files) serves with no model given: greedy decoding is
    deterministic and ends a fortune with EOS, and it predicts held-out fortunes far better than chance."""
    import gzip
    import math

    from service.finetune.data import tokenize
    from service.finetune.trainer import loss_sum

    llm = LLM(None, device="cpu")
    engine = llm.engine
    assert engine.model_dir.name == "default_model"
    cfg = engine.model.config
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == (4096, 6, 320)
    assert len(llm.tokenizer) == cfg.vocab_size == VOCAB
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    first, again = (llm.generate(["Never trust a"], params)[0] for _ in range(2))
    assert first.token_ids == again.token_ids and first.text == again.text
    assert 0 < len(first.token_ids) < 40 and first.finish_reason == "eos_token"
    assert first.text.strip() and first.text.isascii()
    # train_default.py holds out the corpus's first 2%: its loss there was ~4.3 nats/token; chance is ln 4096 = 8.3
    texts = gzip.decompress((engine.model_dir / "corpus.txt.gz").read_bytes()).decode().split("\n%\n")
    examples = [tokenize({"text": t}, llm.tokenizer) for t in texts[:16]]
    with torch.no_grad():
        loss, n = loss_sum(engine.model, examples, "cpu")
    assert loss.item() / n < 5.0 < math.log(cfg.vocab_size)


@pytest.mark.gpu
@pytest.mark.parametrize("settings", [
    dict(max_num_seqs=64, max_num_batched_tokens=512),
    # 4 decodes leave one token to a prompt: a step of one-token rows that does not sample every row
    dict(max_num_seqs=5, max_num_batched_tokens=64, max_mixed_step_tokens=5),
], ids=["batched", "one-token-chunks"])
def test_cuda_graphs_match_eager(model_dir, prompts, settings):
    """Decode graphs (which sample greedy rows themselves), and prefill graphs for prefill and mixed steps (prefix
    hits, padding tokens and sequences): the same tokens and logprobs as eager steps."""
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True)
    outs, logprobs = {}, {}
    for graphs in (False, True):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=512, cuda_graphs=graphs, **settings)
        runner = llm.engine.runner
        assert bool(runner.graphs) == bool(runner.prefill_graphs) == graphs
        replays, replay, run, chunks = [], runner._replay_prefill, runner.run, []
        runner._replay_prefill = lambda key, *args: replays.append(key) or replay(key, *args)

        def counting_run(batch, pending):
            one_token_rows = sum(batch.num_tokens) == len(batch.seqs)
            chunks.append(one_token_rows and any(s.num_computed_tokens < len(s.token_ids) for s in batch.seqs))
            return run(batch, pending)

        runner.run = counting_run
        step, logprobs[graphs] = llm.engine.step, []

        def recording_step():
            outputs, stats = step()
            logprobs[graphs] += [(o.request_id, o.logprob) for o in outputs]
            return outputs, stats

        llm.engine.step = recording_step
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        assert bool(replays) == graphs
        assert any(chunks) or "max_mixed_step_tokens" not in settings
        assert_no_leaks(llm)
    assert outs[True] == outs[False]
    eager, graphed = sorted(logprobs[False]), sorted(logprobs[True])
    assert [r for r, _ in eager] == [r for r, _ in graphed] and all(lp <= 0 for _, lp in graphed)
    assert [lp for _, lp in graphed] == pytest.approx([lp for _, lp in eager], abs=1e-3)


def test_the_pdl_primer_runs_only_where_graphs_use_pdl(device):
    """kernels/pdl_primer.py: wanted on CUDA from Hopper on (programmatic dependent launch), never on the CPU; its
    kernel runs (here: in the interpreter without CUDA)."""
    from kernels.pdl_primer import _primer_kernel, wants_primer

    assert not wants_primer(torch.device("cpu"))
    if device == "cuda":
        assert wants_primer(torch.device("cuda", 0)) == (torch.cuda.get_device_capability(0)[0] >= 9)
    _primer_kernel[(1,)](torch.empty(1, device=device), PDL=False)


@pytest.mark.gpu
def test_each_graph_replay_follows_the_pdl_primer(model_dir, prompts):
    """On Hopper the engine launches the primer (kernels/pdl_primer.py) once before each replay of a graph, decode
    and prefill, and with it switched off never; the tokens are the same either way."""
    from service.engine.model_runner import EAGER

    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=512, max_num_seqs=8)
    runner = llm.engine.runner
    if not runner.pdl_primer:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    execute, replays = runner.execute, []
    runner.execute = lambda plan, pending: replays.append(plan.kind != EAGER) or execute(plan, pending)
    outs, primers, graph_steps = {}, {}, {}
    for on in (True, False):
        runner.pdl_primer, replays[:] = on, []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            outs[on] = [o.token_ids for o in llm.generate(prompts[:3], GREEDY)]
            torch.cuda.synchronize()
        primers[on] = sum(e.name.startswith("_primer_kernel") for e in prof.events())
        graph_steps[on] = sum(replays)
    assert graph_steps[True] >= 10, graph_steps  # a prefill graph, then decode graphs
    assert primers == {True: graph_steps[True], False: 0}
    assert outs[True] == outs[False]
    assert_no_leaks(llm)


@pytest.mark.gpu
def test_grammars_and_forks_on_the_gpu_with_graphs_and_overlap(model_dir, prompts):
    """On CUDA (graphs, overlapped steps, masks copied from pinned memory): grammar rows validate, n completions
    fork from one prefill and, greedy, equal the single completion; free rows equal a run without the others."""
    import jsonschema

    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=512, max_num_seqs=64)
    assert llm.engine.overlap and llm.engine.runner.graphs
    free = [o.token_ids for o in llm.generate(prompts[:8], GREEDY)]
    person = SamplingParams(max_new_tokens=120, temperature=1.0, seed=1, grammar=Grammar("json", json.dumps(PERSON)))
    params = [person if i % 2 else GREEDY for i in range(8)] + [msgspec.structs.replace(GREEDY, n=4)]
    outs = llm.generate(prompts[:8] + [prompts[8]], params)
    for i, out in enumerate(outs[:8]):
        if i % 2:
            assert out.finish_reason == "eos_token"
            jsonschema.validate(json.loads(llm.tokenizer.decode(out.token_ids[:-1])), PERSON)
        else:
            assert out.token_ids == free[i]
    single = llm.generate(prompts[8], GREEDY)[0].token_ids
    assert [o.token_ids for o in outs[8:]] == [single] * 4
    assert_no_leaks(llm)


def test_sampler_grammar_masks_forbid_every_other_token_and_the_ids_past_the_tokenizer():
    logits = torch.zeros(3, 70)
    logits[:, 60] = 50.0  # an id past the masks' 32 tokens (a padded embedding): never allowed
    logits[:, 9] = 40.0  # allowed in no mask
    masks = torch.tensor([[(1 << 3) | (1 << 5)], [1 << 7]], dtype=torch.int32)
    free = SamplingParams(temperature=0.0)
    tokens = Sampler()(logits, [free, SamplingParams(temperature=1.0, seed=0), free], [None] * 3,
                       masks=(masks, [0, 1])).fetch()[0]
    assert tokens[0] in (3, 5) and tokens[1] == 7 and tokens[2] == 60


@pytest.mark.parametrize("spread_ms", [0.0, 1e9], ids=["threads", "one-by-one"])
def test_grammar_masks_of_many_rows_filled_on_threads_equal_those_filled_one_by_one(monkeypatch, spread_ms):
    """Grammars.fill_masks shares the rows among threads where masks are dear (SPREAD_MS 0: always): every row's bits
    (a JSON schema, any JSON, a regex, each at its own point of the output, and a finished row that allows
    everything) equal its matcher's own fill."""
    from service.engine import grammar as grammar_module
    from service.engine.grammar import Grammars
    from service.text import load_tokenizer

    monkeypatch.setattr(grammar_module, "SPREAD_MS", spread_ms)
    grammars = Grammars(DEFAULT_MODEL_DIR, 4096, [2], fill_threads=3)
    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    person = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    rows = [(Grammar("json", person), '{"name": "Al'), (Grammar("json"), '{"a": [1, '), (Grammar("json"), ""),
            (Grammar("regex", r"[a-z]{2,5}-\d{3}"), "abc-1"), (Grammar("regex", "yes|no"), "yes"),
            (Grammar("json", person), "")]
    matchers = []
    for grammar, said in rows:
        matcher = grammars.matcher(grammars.compile(grammar).result())
        assert all(Grammars.accept([matcher], [t]) == [True] for t in tokenizer.encode(said, add_special_tokens=False))
        matchers.append(matcher)
    matchers[4].accept_token(2)  # "yes" then EOS: finished
    assert matchers[4].is_terminated()
    grammars.fill_masks(matchers, json_rows=[])  # the first step measures what a mask costs
    filled = grammars.fill_masks(matchers, json_rows=[])
    for row, matcher in enumerate(matchers):
        alone = torch.full((1, grammars.words), -1, dtype=torch.int32)
        if not matcher.is_terminated():
            matcher.fill_next_token_bitmask(alone, 0)
        assert torch.equal(filled[row], alone[0]), row
    assert not torch.equal(filled[0], filled[1]) and (filled[4] == -1).all()
    grammars.shutdown()


def test_cheap_grammar_masks_go_back_to_one_thread_after_a_step_on_threads(monkeypatch):
    """A step that shared its rows among threads judges the next by the rows' own CPU time: handing 64 cheap rows out
    (any-JSON masks on the embedded vocabulary) costs more than filling them, and judging by the shared step's wall
    time kept every later step on threads (the constrained decode's 0.36x on an H200)."""
    from service.engine import grammar as grammar_module
    from service.engine.grammar import Grammars

    grammars = Grammars(DEFAULT_MODEL_DIR, 4096, [2], fill_threads=8)
    matchers = [grammars.matcher(grammars.compile(Grammar("json")).result()) for _ in range(64)]
    spread_ms = grammar_module.SPREAD_MS
    monkeypatch.setattr(grammar_module, "SPREAD_MS", 0.0)  # as after a dear step: this one is shared
    for _ in range(3):
        grammars.fill_masks(matchers, json_rows=list(range(64)))
        assert len(matchers) * grammars._row_ms < spread_ms  # the next step, at the shipped threshold: one thread
    assert len(grammars._fill_pool._threads) > 1  # the rows were shared
    grammars.shutdown()


def test_the_first_grammars_compile_timeout_does_not_count_the_compilers_start(tmp_path):
    """The first grammars wait while the compiler starts (xgrammar reads the vocabulary: ~0.5 s for a 151,936-token
    one here): a 3 ms regex under a 0.1 s grammar_compile_timeout compiles, where that wait used to refuse it as too
    complex, and from then on at once."""
    from benchmarks.serve import write_word_tokenizer
    from service.engine.grammar import CompileQueue, Grammars

    write_word_tokenizer(tmp_path, 151936, eos_token_id=151643)
    grammars = Grammars(tmp_path, 151936, [151643])
    queue = CompileQueue(grammars, timeout=0.1, wake=lambda: None)
    queue.add(Grammar("regex", "(w[0-9]{1,2}){1,3}"), "r1", "item")
    ready = refused = []
    deadline = time.monotonic() + 30
    while not (ready or refused) and time.monotonic() < deadline:
        ready, refused = queue.poll()
        time.sleep(0.01)
    assert not refused and [item for item, _ in ready] == ["item"], refused
    grammars.shutdown()


def test_the_tokenizers_eos_id_is_read_from_its_files(model_dir):
    """The engine core takes the tokenizer's EOS id from tokenizer_config.json and tokenizer.json, without loading
    the tokenizer: it must be the id the tokenizer itself has."""
    from service.text import eos_token_id, load_tokenizer

    for d in (model_dir, DEFAULT_MODEL_DIR):
        assert eos_token_id(d) == load_tokenizer(d).eos_token_id is not None
