"""service/strict_json.py: the nesting bound is the service's own, the same on every Python (3.11's json.loads
stops near 1,000 levels, 3.12's and 3.13's take thousands); it counts arrays and objects, not brackets in strings."""
import json

import pytest

from service import strict_json
from service.strict_json import MAX_DEPTH


def nested(depth: int) -> str:
    return '{"a": ' * (depth // 2) + "[" * (depth - depth // 2) + "1" + "]" * (depth - depth // 2) + "}" * (depth // 2)


def test_nesting_up_to_the_bound_is_read():
    text = nested(MAX_DEPTH)
    assert strict_json.loads(text) == json.loads(text)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1_200, 50_000])  # 1,200: more than 3.11's parser takes, not 3.12's
def test_deeper_nesting_is_a_value_error_naming_it(depth):
    with pytest.raises(ValueError, match=f"nested too deeply \\(more than {MAX_DEPTH} "):
        strict_json.loads(nested(depth))


def test_brackets_in_strings_and_wide_values_are_not_depth():
    text = json.dumps({"s": "[" * 50_000, "quoted": '\\"' + "{" * 300 + '"', "wide": [[i] for i in range(5_000)],
                       "objects": [{"k": {}}] * 500})
    assert strict_json.loads(text) == json.loads(text)
    assert strict_json.loads(f'["\\\\", {nested(MAX_DEPTH - 1)}]') == ["\\", json.loads(nested(MAX_DEPTH - 1))]
    with pytest.raises(ValueError, match="nested too deeply"):  # a string ending in an escaped backslash
        strict_json.loads(f'["\\\\", {nested(MAX_DEPTH)}]')
