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
_TOO_DEEP = f"nested too deeply (more than {MAX_DEPTH} arrays or objects within each other)"


def loads(text: str):
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None
    if _deeper_than(value, MAX_DEPTH, text):
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


def _deeper_than(value, limit: int, text: str) -> bool:
    if text.count("[") + text.count("{") <= limit:  # too few brackets to nest that deep: no walk
        return False
    stack = [(value, 1)]
    while stack:  # iterative, as the walks this bound protects are not
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        nested = [c for c in children if isinstance(c, (dict, list))]
        if nested and depth >= limit:
            return True
        stack.extend((c, depth + 1) for c in nested)
    return False
