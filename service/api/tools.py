"""Tool calling on /v1/chat/completions: the conversation as the chat template expects it, the grammar that makes
`tool_choice: "required"` or a named function produce valid calls, and the parsing of a model's calls out of its
text, whole or while it streams.

Two output formats are understood, chosen from the chat template: Hermes / Qwen2.5's
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (also the default) and Llama 3.1's bare JSON object
`{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`, several separated by `;`). A forced
choice does not rely on either: its output is constrained to JSON (the arguments of the named function, or an
array of {"name", "parameters"} for "required") and converted to calls here.
"""
import json
import re
import secrets

from service import strict_json
from service.protocol import Grammar

HERMES, LLAMA3 = "hermes", "llama3"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def tool_format(chat_template: str | None) -> str:
    """The format the model was taught, judged from its chat template's markup."""
    template = chat_template or ""
    if _HERMES_OPEN not in template and (_PYTHON_TAG in template or "ipython" in template):
        return LLAMA3
    return HERMES


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def template_messages(messages) -> list[dict]:
    """The request's messages as chat templates read them: a call's arguments as an object (templates print them
    with `tojson`), a tool's answer with the id of its call."""
    result = []
    for m in messages:
        message = {"role": m.role, "content": m.content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": _object(c.function.arguments)}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        result.append(message)
    return result


def _object(arguments: str):
    """The arguments' JSON value; their text where that is not valid JSON, or not text either (a lone surrogate
    escape, which no tokenizer takes), or nested too deeply: the model is shown what it was sent."""
    try:
        return strict_json.loads(arguments)
    except ValueError:
        return arguments


def _parameters(function) -> dict:
    """A function's arguments schema, always an object's (none: an empty object)."""
    parameters = function.parameters
    if parameters is None:
        return {"type": "object", "properties": {}}
    return parameters if "type" in parameters else {"type": "object", **parameters}


def _placed(schema, at: str):
    """schema, to sit at JSON pointer `at` inside a larger one: its local $refs ("#...") made to point there."""
    if isinstance(schema, dict):
        return {k: at + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _placed(v, at)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_placed(v, at) for v in schema]
    return schema


def forced_grammar(tools, choice, parallel: bool) -> Grammar | None:
    """The grammar of a forced choice: a named function's arguments, or for "required" an array of calls (one,
    unless parallel calls are allowed); None when the model chooses ("auto", "none"). Each function's parameters
    sit under $defs of the array's schema, so that their own $refs still resolve."""
    if not isinstance(choice, str):
        function = next(t.function for t in tools if t.function.name == choice.function.name)
        return Grammar("json", json.dumps(_parameters(function)))
    if choice != "required":
        return None
    calls = [{"type": "object", "required": ["name", "parameters"],
              "properties": {"name": {"const": t.function.name}, "parameters": {"$ref": f"#/$defs/f{i}"}}}
             for i, t in enumerate(tools)]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
              "$defs": {f"f{i}": _placed(_parameters(t.function), f"#/$defs/f{i}") for i, t in enumerate(tools)}}
    if not parallel:
        schema["maxItems"] = 1
    return Grammar("json", json.dumps(schema))


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


# The next call's head in a "required" output, past the array's "[" or the previous call's "}, ".
_REQUIRED_HEAD = re.compile(r'[^{]*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"parameters"\s*:\s*')


class ForcedCalls:
    """The calls of a forced tool_choice, read while the model writes them: a named function's arguments are the
    whole output; "required" writes a JSON array of {"name", "parameters"} (forced_grammar). A call's name and
    arguments stream as soon as they are written, and an output cut short (max_tokens) keeps what it wrote: its
    calls, the last one with the arguments written so far."""

    def __init__(self, choice):
        self.named = None if isinstance(choice, str) else choice.function.name
        self.calls: list[dict] = []
        self.text = ""
        self._at = 0  # "required": the first character not parsed yet
        self._depth = 0  # inside the current call's arguments: open brackets, and whether in a string / an escape
        self._in_string = self._escape = self._in_arguments = False

    def feed(self, piece: str) -> list[dict]:
        """The tool_calls deltas of `piece`: a call's opening (index, id, type, name), then its arguments text."""
        self.text += piece
        if self.named is not None:
            if not self.calls:
                self.calls.append(_call(self.named, piece))
                return [self._opening(0, piece)]
            self.calls[0]["function"]["arguments"] += piece
            return [{"index": 0, "function": {"arguments": piece}}] if piece else []
        deltas = []
        while self._at < len(self.text):
            if not self._in_arguments:
                head = _REQUIRED_HEAD.match(self.text, self._at)
                if head is None:
                    break  # not written yet, or the array's end
                self.calls.append(_call(head[1], ""))
                deltas.append(self._opening(len(self.calls) - 1, ""))
                self._at, self._in_arguments = head.end(), True
            while self._depth == 0 and self._at < len(self.text) and self.text[self._at].isspace():
                self._at += 1  # between "parameters": and the object, when the head matched before it came
            start = self._at
            self._scan()
            if self._at > start:
                written = self.text[start:self._at]
                self.calls[-1]["function"]["arguments"] += written
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": written}})
            if self._in_arguments:
                break
        return deltas

    def _opening(self, index: int, arguments: str) -> dict:
        call = self.calls[index]
        return {"index": index, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": arguments}}

    def _scan(self) -> None:
        """Advances over the current call's arguments (a JSON object) to their end or to the end of the text."""
        text, i = self.text, self._at
        while i < len(text):
            c = text[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._in_arguments = False
                    break
        self._at = i

    def content(self) -> str | None:
        """The output as text when it holds no call at all (cut short before a name): it is never dropped."""
        return None if self.calls or not self.text else self.text


def _json_calls(pieces, key: str) -> list[dict] | None:
    """Calls from JSON texts of {"name", key: {...}}; None unless every piece is one."""
    calls = []
    for piece in pieces:
        try:
            value = json.loads(piece)
        except ValueError:
            return None
        if not (isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get(key), dict)):
            return None
        calls.append(_call(value["name"], value[key]))
    return calls


def parse_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a model's reply under tool_choice "auto": the text outside the calls, or None when
    there is none; calls that do not parse leave the whole text as content."""
    if fmt == LLAMA3:
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if body.startswith("{"):
            calls = _json_calls([p for p in body.split(";") if p.strip()], "parameters")
            if calls is None:
                calls = _json_calls([p for p in body.split(";") if p.strip()], "arguments")
            if calls:
                return None, calls
        return text, []
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = _json_calls(_HERMES_CALL.findall(text[start:]), "arguments")
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


class CallStream:
    """Streams a reply under tool_choice "auto": text goes out as content until what could open a call appears;
    from there the text is held, and turned into tool_calls deltas (or released as content) when the reply ends."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.held = ""  # text that may be, or is, a call
        self.calling = False  # a call has begun: everything from here is held
        self.sent_content = False

    def feed(self, text: str) -> str:
        """The content that can go out now."""
        self.held += text
        if self.calling:
            return ""
        if self.fmt == LLAMA3:
            stripped = self.held.lstrip()
            if not self.sent_content and (not stripped or stripped[0] == "{" or stripped.startswith(_PYTHON_TAG)
                                          or _PYTHON_TAG.startswith(stripped)):
                return ""  # a reply that opens like a call is held to its end
            self.sent_content = True
            out, self.held = self.held, ""
            return out
        at = self.held.find(_HERMES_OPEN)
        if at >= 0:
            self.calling = True
            out, self.held = self.held[:at], self.held[at:]
            return out
        keep = next((k for k in range(min(len(_HERMES_OPEN) - 1, len(self.held)), 0, -1)
                     if _HERMES_OPEN.startswith(self.held[-k:])), 0)  # a marker cut between tokens
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to send, calls) at the end of the reply."""
        content, calls = parse_calls(self.held, self.fmt)
        if not calls:
            return self.held, []
        return content or "", calls
