"""Incremental detokenization and stop-string handling for one sequence."""


class IncrementalDetokenizer:
    """Turns generated tokens into text pieces. Decodes a short window of recent tokens so that merges across
    token boundaries come out right, and emits nothing while the window ends in an incomplete UTF-8
    character. Text that could be the start of a stop string is held back until it is known not to be one;
    the text after a stop string is never emitted, the stop string itself only with include_stop."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], include_stop: bool = False):
        # The Rust tokenizer directly: the transformers wrapper costs more than the decode itself.
        self.decoder = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
        self.tokens = list(prompt_token_ids[-6:])  # context for the first generated tokens' spacing
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # all generated text so far
        self.emitted = 0  # chars of self.text already returned
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop

    def _decode(self, ids) -> str:
        return self.decoder.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Returns (new text to emit, whether a stop string was hit)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if self.stop:
            # A stop string can only end inside the text added since the last check.
            lo = max(0, self.emitted - max(map(len, self.stop)))
            hits = [(i, len(s)) for i, s in ((self.text.find(s, lo), s) for s in self.stop) if i >= 0]
            if hits:
                start, length = min(hits)
                self.text = self.text[:start + length if self.include_stop else start]
                return self.flush(), True
        end = len(self.text) - self._stop_prefix_len()
        piece = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece, False

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
        piece = self.text[self.emitted:]
        self.emitted = len(self.text)
        return piece
