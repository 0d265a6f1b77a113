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
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _parameters(function) -> dict:
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def forced_grammar(tools, choice, parallel: bool) -> Grammar | None:
    """The grammar of a forced choice: a named function's arguments, or for "required" an array of calls (one,
    unless parallel calls are allowed); None when the model chooses ("auto", "none")."""
    if not isinstance(choice, str):
        function = next(t.function for t in tools if t.function.name == choice.function.name)
        return Grammar("json", json.dumps(_parameters(function)))
    if choice != "required":
        return None
    calls = [{"type": "object", "required": ["name", "parameters"],
              "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t.function)}}
             for t in tools]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return Grammar("json", json.dumps(schema))


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def forced_calls(text: str, choice) -> list[dict]:
    """The calls in the output of a forced choice (see forced_grammar); [] if it was cut short."""
    if not isinstance(choice, str):
        return [_call(choice.function.name, text)]
    try:
        return [_call(c["name"], c["parameters"]) for c in json.loads(text)]
    except (ValueError, TypeError, KeyError):
        return []


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
