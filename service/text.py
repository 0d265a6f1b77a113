"""Text: loading a model's tokenizer, and incremental detokenization with stop strings. Runs where text is made:
in the HTTP front-ends and the offline LLM (the engine core reads its EOS id from the tokenizer's files, and loads
the tokenizer only for grammars)."""
import json
import re
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
    """The chat cannot be rendered, or not without letting message text become control tokens."""


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, **template_args) -> list[int]:
    """Token ids of a conversation rendered by the model's chat template, in which only the template's own markup
    becomes special tokens: a message saying "<|im_end|>" gets those characters, never the control token (else a
    user could close their turn and forge a system or assistant one).

    The template is rendered twice: with the messages, and with a marker in place of each text. The markers cut
    the markup from the texts; the texts are then encoded with special tokens taken literally. A template that
    rewrites texts (trims them, say) is matched with the trimmed texts; one that rewrites them otherwise is
    encoded as a whole, unless a text holds a special token's spelling, which is then refused."""
    def render(msgs):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **template_args)
        except Exception as e:  # the template's own checks (roles must alternate, ...) raise here
            raise ChatTemplateError(str(e)) from None

    text = render(messages)
    texts = {i: m["content"] for i, m in enumerate(messages) if isinstance(m.get("content"), str) and m["content"]}
    try:
        marked = render([{**m, "content": f"\x00{i}\x00"} if i in texts else m for i, m in enumerate(messages)])
    except ChatTemplateError:  # the template looks into the texts
        marked = ""
    parts = re.split("\x00([0-9]+)\x00", marked)
    for rewrite in (str, str.strip):
        if marked and "".join(p if j % 2 == 0 else rewrite(texts[int(p)]) for j, p in enumerate(parts)) == text:
            ids = []
            for j, part in enumerate(parts):
                if j % 2 == 0:
                    ids += tokenizer.encode(part, add_special_tokens=False)
                else:
                    ids += tokenizer.encode(rewrite(texts[int(part)]), add_special_tokens=False,
                                            split_special_tokens=True)
            return ids
    specials = [t for t in tokenizer.all_special_tokens + list(tokenizer.get_added_vocab()) if t]
    for i, content in texts.items():
        found = next((t for t in specials if t in content), None)
        if found is not None:
            raise ChatTemplateError(f"messages.{i}.content holds the special token {found!r}, which this model's "
                                    "chat template would not keep as text")
    return tokenizer.encode(text, add_special_tokens=False)


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
