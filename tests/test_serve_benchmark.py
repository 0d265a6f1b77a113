"""benchmarks/serve.py: its CPU mode end to end (shortened), and the word-level tokenizer its GPU run writes."""
import json

import pytest

from tests.helpers import run_benchmark

ROW_KEYS = {"mode", "endpoint", "tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "requests",
            "errors"}


def test_word_level_tokenizer_makes_every_token_visible_text(tmp_path):
    from benchmarks.serve import write_word_tokenizer
    from service.text import TextStream, load_tokenizer

    write_word_tokenizer(tmp_path, 151936, eos_token_id=151643)
    # Beside a Qwen2 config, as in the benchmark (transformers' AutoTokenizer then picks Qwen2Tokenizer, which
    # encodes these words to nothing; the service loads tokenizer.json as it is).
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer) == 151936 and tokenizer.eos_token_id == 151643
    assert tokenizer.encode("w5 w77") == [5, 77] and tokenizer.decode([5, 77]) == "w5 w77"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "w5 w77"}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    assert len(prompt) == 7 and prompt[2:4] == [5, 77] and tokenizer.unk_token_id not in prompt
    # What the server streams: one piece of text per generated token.
    detokenizer = TextStream(tokenizer, prompt, stop=[])
    assert [detokenizer.add(t)[0] for t in (9, 151000, 42)] == [" w9", " w151000", " w42"]


def test_load_levels_count_tokens_in_the_window_and_latencies_of_requests_started_in_it():
    from benchmarks.load_generator import Level, Record, summarize

    records = [Record(0.5, tokens=[0.9, 1.1, 1.2], ok=True),  # started in the warm-up: only its tokens count
               Record(1.0, tokens=[1.2, 1.21, 1.22], ok=True),
               Record(2.0, tokens=[2.9, 3.1], ok=True),  # TTFT 900 ms: not good
               Record(2.5, error="HTTP 500"),
               Record(2.8, tokens=[2.95, 2.99])]  # cut: still running at the cut-off, timed but not good
    r = summarize(Level(records, (1.0, 3.0), [0.1, 0.2]))
    assert r["tok_per_s"] == 8 / 2 and (r["requests"], r["errors"], r["cut"]) == (4, 1, 1)
    assert r["ttft_p50_ms"] == pytest.approx(200) and r["itl_p50_ms"] == pytest.approx(25)
    assert r["goodput_rps"] == 0.5 and r["loadgen_cpu_util"] == [0.1, 0.2]


def test_stream_events_are_parsed_per_endpoint():
    from benchmarks.load_generator import CHAT, TGI, StreamError, _parse

    assert _parse(TGI, b'{"index": 1, "token": {"id": 5}, "generated_text": null}') == (True, False, None)
    assert _parse(TGI, b'{"token": {"id": 5}, "generated_text": "w5", "details": {"generated_tokens": 1}}') == (
        True, True, 1)
    assert _parse(CHAT, b'{"choices": [{"delta": {"role": "assistant", "content": ""}}]}') == (False, False, None)
    assert _parse(CHAT, b'{"choices": [{"delta": {"content": " w5"}}]}') == (True, False, None)
    assert _parse(CHAT, b'{"choices": [], "usage": {"completion_tokens": 3}}') == (False, False, 3)
    assert _parse(CHAT, b"[DONE]") == (False, True, None)
    with pytest.raises(StreamError):
        _parse(TGI, b'{"error": "generation failed", "error_type": "generation"}')


def test_cpu_mode_serves_32_streams_near_the_offline_engine(tmp_path):
    # One torch thread in the engine and the server: with one per core, every operator ends at a barrier that
    # stalls whenever another process (here the load generator, on CI any neighbour) takes a core, and steps
    # then vary tenfold. With one thread the embedded model's steps are as fast and steady.
    done = run_benchmark("serve", "--device", "cpu", "--out", str(tmp_path), "--new-tokens", "32", "--warmup", "2",
                         "--seconds", "8", "--cpu-threads", "1", timeout=300)
    results = json.loads((tmp_path / "serve.json").read_text())
    assert (tmp_path / "serve.png").stat().st_size > 0
    for key in ("startup_cold_s", "startup_warm_s", "graph_step_ms_batch1", "gpu", "torch", "triton", "git_commit",
                "api_server_count", "model", "served_over_offline", "loadgen_cpu_util_max"):
        assert key in results, key
    rows = results["rows"]
    assert {(r["mode"], r["endpoint"], r["concurrency"]) for r in rows} == {
        ("offline", None, 32), ("served", "/generate_stream", 32)}
    for row in rows:
        assert ROW_KEYS <= row.keys(), row
        assert row["errors"] == 0 and row["requests"] > 0 and row["tok_per_s"] > 0, row
    fresh = {r["connection"]: r for r in results["fresh_connection"]}
    assert fresh.keys() == {"new", "kept_alive"} and all(r["requests"] == 10 for r in fresh.values()), fresh
    # Issue 34: a new connection cost 33 ms of TTFT (delayed ACKs); now it costs its connect.
    assert fresh["new"]["ttft_p50_ms"] < fresh["kept_alive"]["ttft_p50_ms"] + 20, fresh
    served = next(r for r in rows if r["mode"] == "served")
    assert served["loadgen_processes"] >= 1 and 0 < max(served["loadgen_cpu_util"]) < 1
    # The issue asks 0.8x and the benchmark reports it; a loose bound here, the CPU of a test machine is shared.
    assert results["served_over_offline"]["/generate_stream"]["32"] >= 0.5, done.stdout[-2000:]
