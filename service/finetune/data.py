"""Training data: JSONL parsing and validation, then tokenization with a loss mask that covers only what the
model should learn to produce.

Each line is one of
    {"prompt": str, "completion": str}   loss on the completion (and the EOS after it)
    {"messages": [{"role", "content"}]}  rendered with the tokenizer's chat template; loss on assistant turns
    {"text": str}                        loss on every token (plain language modelling)

The front-end that accepts a job tokenizes its files once and stores the examples beside them (save_examples);
the engine core reads them back when the job starts (load_examples), so its loop never waits on the tokenizer.
"""
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from service import strict_json
from service.text import encode_chat

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class Example:
    token_ids: list[int]
    loss_mask: list[bool]  # True where token_ids[i] is a target (predicted from the tokens before it)

    @property
    def num_target_tokens(self) -> int:
        return sum(self.loss_mask[1:])


MAX_MESSAGES = 256  # messages of one chat example (each assistant turn renders its prefix: quadratic)


def parse_jsonl(data: bytes, max_messages: int = MAX_MESSAGES) -> list[dict]:
    """The records of a training file; ValueError naming the first bad line."""
    if not data.strip():
        raise ValueError("the file is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the file is not valid UTF-8 (byte {e.start})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = strict_json.loads(line)
        except ValueError as e:
            raise ValueError(f"line {number}: not valid JSON ({e})") from None
        try:
            check_record(record, max_messages)
        except ValueError as e:
            raise ValueError(f"line {number}: {e}") from None
        records.append(record)
    return records


def check_record(record, max_messages: int = MAX_MESSAGES) -> None:
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    kinds = [k for k in ("prompt", "messages", "text") if k in record]
    if len(kinds) != 1:
        raise ValueError('expected exactly one of {"prompt", "completion"}, {"messages"} or {"text"}')
    allowed = {"prompt": {"prompt", "completion"}, "messages": {"messages"}, "text": {"text"}}[kinds[0]]
    unknown = set(record) - allowed
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    if kinds[0] == "prompt":
        if not isinstance(record["prompt"], str) or not isinstance(record.get("completion"), str):
            raise ValueError('"prompt" and "completion" must both be strings')
        if not record["completion"]:
            raise ValueError('"completion" is empty')
    elif kinds[0] == "text":
        if not isinstance(record["text"], str) or not record["text"]:
            raise ValueError('"text" must be a non-empty string')
    else:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError('"messages" must be a non-empty list')
        if len(messages) > max_messages:
            raise ValueError(f'"messages" has {len(messages)} messages; at most {max_messages} are allowed')
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be {{'role': one of {ROLES}, 'content': str}}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("messages has no assistant turn to learn from")


def tokenize(record: dict, tokenizer, max_len: int | None = None) -> Example:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if "prompt" in record:
        # The prompt is encoded alone, as the serving path encodes it, so training sees the same tokens.
        prompt = tokenizer.encode(record["prompt"])
        completion = tokenizer.encode(record["completion"], add_special_tokens=False) + eos
        return Example(prompt + completion, [False] * len(prompt) + [True] * len(completion))
    if "text" in record:
        ids = tokenizer.encode(record["text"]) + eos
        return Example(ids, [True] * len(ids))
    return _tokenize_chat(record["messages"], tokenizer, max_len)


def _tokenize_chat(messages: list[dict], tokenizer, max_len: int | None = None) -> Example:
    """Renders growing prefixes of the conversation; an assistant turn's tokens are what its message adds
    after the generation prompt of the turns before it."""
    if tokenizer.chat_template is None:
        raise ValueError("the model's tokenizer has no chat template; use prompt/completion or text records")

    pieces = {}  # the prefixes share their pieces' tokens

    def encode(turns, generation_prompt):  # as the chat route encodes a conversation
        return encode_chat(tokenizer, turns, add_generation_prompt=generation_prompt, cache=pieces)

    ids = encode(messages, False)
    if max_len is not None and len(ids) > max_len:  # before the work per assistant turn
        return Example(ids, [False] * len(ids))
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix, upto = encode(messages[:i], True), encode(messages[:i + 1], False)
        if ids[:len(upto)] != upto or upto[:len(prefix)] != prefix:
            raise ValueError("the chat template does not render conversations prefix-consistently")
        mask[len(prefix):len(upto)] = [True] * (len(upto) - len(prefix))
    return Example(ids, mask)


def tokenize_records(records: list[dict], tokenizer, max_len: int) -> list[Example]:
    """ValueError naming the first record that is longer than the context or has nothing to learn."""
    examples = []
    for i, record in enumerate(records, start=1):
        ex = tokenize(record, tokenizer, max_len)
        if len(ex.token_ids) > max_len:
            raise ValueError(f"example {i} is {len(ex.token_ids)} tokens, longer than the context length {max_len}")
        if ex.num_target_tokens == 0:
            raise ValueError(f"example {i} has no tokens to learn from")
        examples.append(ex)
    return examples


def examples_path(files_dir: Path, file_id: str) -> Path:
    return Path(files_dir) / f"{file_id}.examples"


def save_examples(files_dir: Path, file_id: str, examples: list[Example]) -> None:
    path = examples_path(files_dir, file_id)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.msgpack.encode(examples))
    os.replace(tmp, path)


def load_examples(files_dir: Path, file_id: str) -> list[Example]:
    return msgspec.msgpack.decode(examples_path(files_dir, file_id).read_bytes(), type=list[Example])
