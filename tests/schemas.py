"""JSON schemas the structured-output tests share."""

# A string of a character class that holds no character: the grammar accepts '{"a": "' and then nothing, so a
# request reaches a dead end mid-output. (xgrammar 0.2.9 refuses a $ref cycle up front, which was this schema
# before.)
DEAD_END = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\s\\S]"}}, "required": ["a"]}
