"""JSON text from clients (request bodies, lines of training files), read so that everything it yields can be
tokenized and written back out: a lone UTF-16 surrogate escape ("\\ud800") or nesting too deep for the parser is
a ValueError naming the problem, like any other malformed JSON. NaN and Infinity are read, so that the request
schemas can reject them naming the field."""
import json
import re

# A surrogate escape; valid pairs become one character in json.loads, so only lone ones survive into strings.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def loads(text: str):
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise ValueError("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text")
    return value


def _has_lone_surrogate(value) -> bool:
    stack = [value]
    while stack:  # iterative: the parser already bounded the depth, but not the width
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
