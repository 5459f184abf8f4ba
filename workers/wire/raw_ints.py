"""A worker's answer parsed with one large array of integers kept as its JSON text.

TensorRT-LLM's context worker answers with the prompt's token ids (`prompt_token_ids`, ~20,000
for a Claude Code turn), which the gateway only relays to the generation worker. Parsed, they are
20,000 Python ints made, checked and written back out again, most of the event loop's time for
such a request (the profile: bench/results/2026-12-05-gc-cycles.md). Kept as text, they cost a
scan of their bytes, and `orjson.Fragment` writes them into the next request as they came.

    answer = loads_keeping_ints(content, "prompt_token_ids")
    answer["prompt_token_ids"]  # an orjson.Fragment of the array's text, or what orjson parsed

The array's text is found by its key, cut out, and the rest parsed with a placeholder in its
place. The placeholder must come back as the top-level value of that key, and the text must be a
compact JSON array of positive integers as engines write them; if either fails (a nested object of
that name, a duplicate key, floats, whitespace, a zero), the whole answer is parsed as usual. The
result then reads as `orjson.loads` would have read the answer: the same value, or the same ints as
text, which the generation worker reads as the context worker wrote them. (An integer too long for
64 bits is kept as written too: orjson would read it as a float, which the handoff's check refuses;
the generation worker refuses the token id instead.)
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["loads_keeping_ints"]

# Below this many bytes the ordinary parse is as cheap as the check.
MIN_ARRAY_BYTES = 4096

_PLACEHOLDER = b"0"
_WHITESPACE = b" \t\r\n"
_DIGITS_AND_COMMAS = b"0123456789,"


def loads_keeping_ints(content: bytes, key: str) -> Any:
    """`orjson.loads(content)`, except that a top-level `key` holding a large array of integers
    comes back as an `orjson.Fragment` of the array's JSON text."""
    span = _array_span(content, key.encode())
    if span is None:
        return orjson.loads(content)
    start, end = span
    array = content[start:end]
    if not _is_int_array(array):
        return orjson.loads(content)
    data = orjson.loads(b"".join((content[:start], _PLACEHOLDER, content[end:])))
    if not isinstance(data, dict) or type(data.get(key)) is not int or data[key] != 0:
        return orjson.loads(content)  # the text found was not the top-level value of `key`
    data[key] = orjson.Fragment(array)
    return data


def _array_span(content: bytes, key: bytes) -> tuple[int, int] | None:
    """Where the array after `"key":` starts and ends, if the key is written once and an array
    follows it. (Written twice, the placeholder could come back from another place than the one
    cut out: `{"k": 0, "x": {"k": [...]}}`.)"""
    quoted = b'"' + key + b'"'
    at = content.find(quoted)
    if at < 0 or content.find(quoted, at + 1) >= 0:
        return None
    i = at + len(key) + 2
    n = len(content)
    while i < n and content[i] in _WHITESPACE:
        i += 1
    if i >= n or content[i] != ord(":"):
        return None
    i += 1
    while i < n and content[i] in _WHITESPACE:
        i += 1
    if i >= n or content[i] != ord("["):
        return None
    end = content.find(b"]", i)
    if end < 0 or end + 1 - i < MIN_ARRAY_BYTES:
        return None
    return i, end + 1


def _is_int_array(array: bytes) -> bool:
    """Whether `array` (from `[` to `]`) is a compact JSON array of positive integers without
    leading zeros: what engines write, and valid JSON by construction (each element a digit run
    that starts with 1-9). Anything else (whitespace, a sign, a zero, an empty array) is left to
    the ordinary parse, which is exact and, for such rare answers, cheap enough.

    Only scans in C, three over the array's bytes (cheaper than a regular expression or orjson's
    parse: bench/results/2026-12-05-instructions.md). An id of 20 digits or more is relayed as
    written (see the module's docstring)."""
    inner = array[1:-1]
    return bool(
        inner
        and not inner.translate(None, _DIGITS_AND_COMMAS)
        and not inner.startswith((b",", b"0"))
        and not inner.endswith(b",")
        and b",," not in inner
        and b",0" not in inner
    )
