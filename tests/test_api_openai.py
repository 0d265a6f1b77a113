"""The OpenAI-compatible API against a real server and engine (embedded default model, CPU): the official
openai client unchanged, streaming and not, logprobs, model names, and every validation error."""
import httpx
import openai
import pytest
from server import scrape, serve

PROMPT = "import os\n"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a module."}]


@pytest.fixture(scope="module")
def base_url():
    with serve(cpu_kv_cache_bytes=16 << 20, served_model_name="tiny", max_stop_sequences=4) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].object == "model"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completions(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    assert out.object == "text_completion" and out.model == "tiny"
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text and choice.logprobs is None
    assert out.usage.completion_tokens == 5 and out.usage.total_tokens == out.usage.prompt_tokens + 5
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                      echo=True)
    assert again.choices[0].text == PROMPT + choice.text  # greedy is deterministic; echo prepends the prompt
    lp = again.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) == 2 for top in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)


def test_completions_stream(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_completions_stream_echo_offsets(client):
    """With echo the stream opens with the prompt, and each token's text_offset counts everything sent before it."""
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            echo=True, logprobs=1))
    assert chunks[0].choices[0].text == PROMPT
    sent = len(PROMPT)
    for c in chunks[1:]:
        assert c.choices[0].logprobs.text_offset == [sent]
        sent += len(c.choices[0].text)
    assert sent > len(PROMPT) and len(chunks) == 7


def test_completions_token_prompt_and_seed(client):
    ids = [5, 6, 7, 8]
    a = client.completions.create(model="tiny", prompt=ids, max_tokens=6, seed=1234)
    b = client.completions.create(model="tiny", prompt=ids, max_tokens=6, seed=1234)
    assert a.usage.prompt_tokens == 4 and a.choices[0].text == b.choices[0].text


def test_chat(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3)
    assert out.object == "chat.completion"
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 5 and all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert out.usage.completion_tokens == 5
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stop_sequence(client):
    text = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                          temperature=0).choices[0].message.content
    stop = text[2:5]
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, stop=stop)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content == text[:text.index(stop)]


def test_huggingface_hub_chat_completion(base_url):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=base_url)  # sends model="dummy", which means the served model
    out = client.chat_completion(MESSAGES, max_tokens=3)  # sampled: EOS may come before the limit
    finish, tokens = out.choices[0].finish_reason, out.usage.completion_tokens
    assert (finish, tokens) == ("length", 3) or (finish == "stop" and 1 <= tokens <= 3)
    chunks = list(client.chat_completion(MESSAGES, max_tokens=3, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason


def test_unknown_model_is_404(client, base_url):
    before = scrape(base_url)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    key = ("llm_requests_total", (("endpoint", "chat_completions"), ("outcome", "validation_error")))
    assert scrape(base_url)[key] == before[key] + 1


COMMON_BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4096}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"the": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 3}, "min_tokens"),  # beyond max_tokens (2)
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"bogus": 1}, "bogus"),
    ({"model": None}, "model"),
]
COMPLETIONS_BAD = [({"prompt": ""}, "prompt"), ({"prompt": ["a", 5]}, "prompt"), ({"prompt": 5}, "prompt"),
                   ({"prompt": []}, "prompt"), ({"prompt": ["a", ""]}, "prompt"), ({"prompt": ["a"] * 257}, "prompt"),
                   ({"prompt": [1, -1]}, "prompt"), ({"logprobs": 6}, "logprobs"),
                   ({"prompt": "x = 1\n" * 2000}, "prompt"), ({"best_of": 0}, "best_of"),
                   ({"n": 3, "best_of": 2}, "best_of"), ({"stream": True, "best_of": 2}, "best_of")]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CHAT_BAD = [({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
            ({"top_logprobs": 2}, "top_logprobs"), ({"tools": [{"type": "function"}]}, "tools.0.function"),
            ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
            ({"tool_choice": "required"}, "tool_choice"), ({"tools": [TOOL, TOOL]}, "tools"),
            ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice.function.name"),
            ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
             "response_format"),
            ({"messages": [{"role": "user", "content": "x = 1\n" * 2000}]}, "messages")]


@pytest.mark.parametrize("route,valid,specific", [
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2}, COMPLETIONS_BAD),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}, CHAT_BAD),
])
def test_validation_errors(base_url, route, valid, specific):
    for change, param in COMMON_BAD + specific:
        r = httpx.post(base_url + route, json={**valid, **change})
        assert r.status_code == 422, (change, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (change, error)
        assert error["message"].startswith(param), error
    for content, needle in [(b'{"model": "tiny"', "JSON"), (b'\xff{}', "UTF-8")]:
        r = httpx.post(base_url + route, content=content)
        assert r.status_code == 400 and needle in r.json()["error"]["message"]
    assert httpx.post(base_url + route, json=valid).status_code == 200


def test_penalties_min_p_and_logit_bias_act_as_documented(client):
    """Greedy text from the embedded model repeats itself; OpenAI's penalties (counted on the generated tokens)
    make it repeat less, a logit_bias of +100 makes one token win every step, and min_p = 1 leaves only the most
    likely token (sampling then equals greedy)."""
    def tokens(**controls):
        out = client.completions.create(model="tiny", prompt="the the the", max_tokens=24, logprobs=1,
                                        **({"temperature": 0} | controls))
        return out.choices[0].logprobs.tokens

    base = tokens()
    assert len(set(base)) < len(base)  # it does repeat
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = tokens(**penalty)
        assert penalized != base and len(set(penalized)) > len(set(base)), penalty
    assert tokens(temperature=1.0, seed=3, extra_body={"min_p": 1.0}) == base
    assert tokens(temperature=1.0, seed=3) != base  # without min_p this draw leaves the greedy path
    forced = {token: tokens(logit_bias={str(token): 100}) for token in (42, 43)}
    assert all(len(set(t)) == 1 for t in forced.values()) and forced[42][0] != forced[43][0]


def test_tokenize_and_detokenize_in_vllm_and_tgi_shapes(base_url):
    from service.config import DEFAULT_MODEL_DIR
    from service.text import encode_chat, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    text = "import os\nprint(os.getcwd())"
    r = httpx.post(f"{base_url}/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == encode_chat(tokenizer, MESSAGES, add_generation_prompt=True)
    special = httpx.post(f"{base_url}/tokenize", json={"messages": MESSAGES, "add_special_tokens": True}).json()
    wrapped = tokenizer.encode("a", add_special_tokens=True)  # the embedded tokenizer adds none: same ids
    assert special["tokens"] == chat["tokens"] and wrapped == tokenizer.encode("a", add_special_tokens=False)
    with_tools = httpx.post(f"{base_url}/tokenize", json={"messages": MESSAGES, "tools": [TOOL]}).json()
    usage = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                                 "tools": [TOOL], "max_tokens": 1}).json()["usage"]
    assert with_tools["count"] == usage["prompt_tokens"] > chat["count"]  # the tools rendered, as chat renders them
    back = httpx.post(f"{base_url}/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(r["tokens"])} and text in back["prompt"]
    tgi = httpx.post(f"{base_url}/tokenize", json={"inputs": text}).json()  # TGI's: ids with text and offsets
    assert [t["id"] for t in tgi] == tokenizer.encode(text)
    assert all(text[t["start"]:t["stop"]] == t["text"] for t in tgi) and "".join(t["text"] for t in tgi) == text
    for route, body, param in [("/tokenize", {"prompt": text, "messages": MESSAGES}, "prompt"),
                               ("/tokenize", {}, "prompt"),
                               ("/tokenize", {"prompt": text, "model": "nope"}, "model"),
                               ("/tokenize", {"inputs": ""}, "inputs"),
                               ("/tokenize", {"prompt": text, "tools": [TOOL]}, "tools"),
                               ("/detokenize", {"tokens": [10 ** 8]}, "tokens"),
                               ("/detokenize", {"tokens": [-1]}, "tokens.0"),
                               ("/detokenize", {"tokens": "1 2"}, "tokens")]:
        answer = httpx.post(base_url + route, json=body)
        assert answer.status_code in (404, 422), (body, answer.text)
        error = answer.json()
        assert param in str(error), (body, error)
