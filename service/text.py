"""Text: loading a model's tokenizer, and incremental detokenization with stop strings. Runs where text is made:
in the HTTP front-ends and the offline LLM (the engine core reads its EOS id from the tokenizer's files, and loads
the tokenizer only for grammars)."""
import json
import re
import secrets
from pathlib import Path

from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT = 6  # prompt tokens given to the decoder so the first generated tokens get their spacing right


def load_tokenizer(model_dir):
    """The model's fast (Rust) tokenizer with its chat template. PreTrainedTokenizerFast reads tokenizer.json
    without importing torch, which the front-ends never need; a model without one goes through AutoTokenizer."""
    if (Path(model_dir) / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_id(model_dir) -> int | None:
    """The tokenizer's EOS token id, from its files alone (the engine core's start should not wait seconds for
    transformers' imports): tokenizer_config.json names the token, tokenizer.json numbers it. Loads the tokenizer
    where the files do not say."""
    model_dir = Path(model_dir)
    try:
        eos = json.loads((model_dir / "tokenizer_config.json").read_text())["eos_token"]  # else named elsewhere
        if isinstance(eos, dict):
            eos = eos["content"]
        spec = json.loads((model_dir / "tokenizer.json").read_text())
        added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        return added[eos] if eos in added else spec["model"]["vocab"][eos]
    except (OSError, ValueError, KeyError, TypeError):
        return load_tokenizer(model_dir).eos_token_id


class ChatTemplateError(ValueError):
    """The chat cannot be rendered, or not without letting a client's text become control tokens."""


def chat_text(*values) -> str:
    """Every string in values (dict keys included), joined: all the text a client put into a chat, for a check of
    its size before it is rendered. Iterative: a JSON body nests deeper than Python's recursion reaches."""
    strings, stack = [], list(values)
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
    return "".join(strings)


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, cache: dict | None = None,
                **template_args) -> list[int]:
    """Token ids of a conversation rendered by the model's chat template, in which only the template's own markup
    becomes special tokens: no string of the client's does (a message's text, a call's name or arguments, a tool's
    description...: template_args, the tools, are the client's too). A message saying "<|im_end|>" gets those
    characters, never the control token (else a user could close their turn and forge a system or assistant one).

    The template is rendered twice: as asked, and with a marker in place of each message text and of every other
    string that holds a special token's spelling. The markers cut the markup from those strings, which are then
    encoded with special tokens taken literally; the rest (tools, calls without such spellings) is encoded with the
    markup, as Hugging Face's apply_chat_template(tokenize=True) encodes it. A marker's string is found as the
    template prints it: as it is, trimmed, or escaped by tojson. A template that rewrites the strings otherwise is
    encoded as a whole, unless one of them holds a special token's spelling, which is then refused.

    cache: pieces encoded before, kept across calls that encode overlapping conversations (fine-tuning's growing
    prefixes of one conversation)."""
    def render(msgs, args):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **args)
        except Exception as e:  # the template's own checks (roles must alternate, ...) raise here
            raise ChatTemplateError(str(e)) from None

    text = render(messages, template_args)
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    # Private-use characters, which tojson keeps as they are; the nonce keeps a client from spelling a marker.
    marker = f"\ue000{secrets.token_hex(8)}:{{}}\ue001"
    fields = []  # (field, string) of each marker

    def mark(value, field: str, always: bool = False):
        if isinstance(value, str):
            if not (always and value) and not any(t in value for t in specials):
                return value
            fields.append((field, value))
            return marker.format(len(fields) - 1)
        if isinstance(value, dict):
            return {mark(k, field): mark(v, f"{field}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v, f"{field}.{i}") for i, v in enumerate(value)]
        return value

    # Message texts are cut out even without such spellings (as the model's replies were generated after the
    # markup, not merged with it): the generation prompt's tokens then stay a prefix of the conversation that
    # goes on from it, which fine-tuning's loss masks rely on.
    marked_messages = [{k: mark(v, f"messages.{i}.{k}", always=k == "content") for k, v in m.items()}
                       for i, m in enumerate(messages)]
    marked_args = {k: mark(v, k) for k, v in template_args.items()}  # (service.strict_json bounds the depth)
    try:
        marked = render(marked_messages, marked_args)
    except ChatTemplateError:  # the template looks into the strings
        marked = None
    parts = None if marked is None else re.split(marker.format("([0-9]+)"), marked)
    pieces = parts and _pieces(text, parts, [s for _, s in fields])
    if pieces:  # markup at even places, the client's strings at odd ones
        return _encode_pieces(tokenizer, pieces, {} if cache is None else cache)
    for field, string in fields:
        found = next((t for t in specials if t in string), None)
        if found is not None:
            raise ChatTemplateError(f"{field} holds the special token {found!r}, which this model's chat template "
                                    "would not keep as text")
    return tokenizer.encode(text, add_special_tokens=False)


def _encode_pieces(tokenizer, pieces: list[str], cache: dict) -> list[int]:
    """The token ids of pieces (markup at even places, encoded with special tokens; the client's strings at odd
    ones, their spellings taken literally), those not in cache encoded in one batch of each kind (a call per piece
    cost ~50 us: 10 ms for a 100-message chat)."""
    for literally in (False, True):
        todo = list(dict.fromkeys(p for p in pieces[int(literally)::2] if (p, literally) not in cache))
        if todo:  # the tokenizer refuses an empty batch
            ids = tokenizer(todo, add_special_tokens=False, split_special_tokens=literally)["input_ids"]
            cache.update(((p, literally), i) for p, i in zip(todo, ids))
    return [i for j, piece in enumerate(pieces) for i in cache[piece, j % 2 == 1]]


def _pieces(text: str, parts: list[str], strings: list[str]) -> list[str] | None:
    """text cut as the marked rendering's parts cut it (markup, marker number, markup, ...), each marker's string
    as the template printed it; None where the parts do not rebuild text."""
    pieces, at = [], 0
    for j, part in enumerate(parts):
        if j % 2:
            s, follow = strings[int(part)], parts[j + 1]
            printed = (s, s.strip(), json.dumps(s, ensure_ascii=False)[1:-1])
            part = next((p for p in printed if text.startswith(p + follow, at)), None)
            if part is None:
                return None
        elif not text.startswith(part, at):
            return None
        pieces.append(part)
        at += len(part)
    return pieces if at == len(text) else None


class TextStream:
    """Turns generated tokens into text pieces. The tokenizer's own streaming decoder (Rust) returns nothing while
    a UTF-8 character is split across tokens. Text that could be the start of a stop string is held back until it
    is known not to be one; the text after a stop string is never emitted, the stop string itself only with
    include_stop."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], include_stop: bool = False):
        # The Rust tokenizer directly: the transformers wrapper costs more than the decode itself.
        self.tokenizer = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
        self.decoder = DecodeStream(list(prompt_token_ids[-PROMPT_CONTEXT:]), skip_special_tokens=True)
        self.text = ""  # all generated text so far
        self.emitted = 0  # chars of self.text already returned
        self.stop = [s for s in stop if s]
        self.max_stop = max(map(len, self.stop), default=0)
        self.include_stop = include_stop

    def add(self, token_id: int) -> tuple[str, bool]:
        """Returns (new text to emit, whether a stop string was hit)."""
        piece = self.decoder.step(self.tokenizer, token_id)
        if not self.stop:
            return piece or "", False
        checked = len(self.text)
        self.text += piece or ""
        # A stop string can only end inside the text just added.
        lo = max(0, checked - self.max_stop + 1)
        hits = [(i, len(s)) for i, s in ((self.text.find(s, lo), s) for s in self.stop) if i >= 0]
        if hits:
            start, length = min(hits)
            self.text = self.text[:start + length if self.include_stop else start]
            return self.flush(), True
        end = len(self.text) - self._stop_prefix_len()
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out, False

    def _stop_prefix_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The text held back (a possible stop string's start), once generation ended without it."""
        piece = self.text[self.emitted:]
        self.emitted = len(self.text)
        return piece
