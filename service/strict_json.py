"""JSON text from clients (request bodies, lines of training files), read so that everything it yields can be
tokenized and written back out: a lone UTF-16 surrogate escape ("\\ud800") or nesting deeper than MAX_DEPTH is a
ValueError naming the problem, like any other malformed JSON. NaN and Infinity are read, so that the request
schemas can reject them naming the field."""
import json
import re

# A surrogate escape; valid pairs become one character in json.loads, so only lone ones survive into strings.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

# Arrays and objects within each other: the code that walks a request's values (chat templates, schemas) recurses,
# so the bound is ours, not the interpreter's. json.loads alone stops at Python 3.11's recursion limit (~1000) but
# takes thousands of levels on 3.12 and later (the service image's), where a walk over them would fail deep inside.
MAX_DEPTH = 128
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes (\" among them) included
_BRACKET = re.compile(r"[\[\]{}]")
_TOO_DEEP = f"nested too deeply (more than {MAX_DEPTH} arrays or objects within each other)"


def loads(text: str):
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None
    if _deeper_than(text, MAX_DEPTH):
        raise ValueError(_TOO_DEEP)
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise ValueError("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text")
    return value


def _has_lone_surrogate(value) -> bool:
    stack = [value]
    while stack:  # iterative: loads bounded the depth, but not the width
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _deeper_than(text: str, limit: int) -> bool:
    """Whether the (valid) JSON text nests arrays and objects more than `limit` deep: its brackets outside strings
    counted in order, at a cost that grows with the brackets, not with the values (a body of token ids)."""
    if text.count("[") + text.count("{") <= limit:  # too few brackets to nest that deep
        return False
    depth = 0
    for bracket in _BRACKET.findall(_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > limit:
            return True
    return False
