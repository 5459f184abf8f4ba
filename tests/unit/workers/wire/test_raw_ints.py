"""workers.wire.raw_ints: an answer parsed with its large int array kept as text reads exactly as
`orjson.loads` reads it, whatever the worker sent (property-based)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.wire.raw_ints import loads_keeping_ints

KEY = "prompt_token_ids"
IDS = list(range(1000, 3000))  # 2,000 ids: ~10 KB of text, over the size worth keeping


def read(content: bytes) -> Any:
    """What the parse returns, with a kept array read back as orjson would have read it."""
    data = loads_keeping_ints(content, KEY)
    if isinstance(data, dict) and isinstance(data.get(KEY), orjson.Fragment):
        data = {**data, KEY: orjson.loads(orjson.dumps(data[KEY]))}
    return data


def test_a_context_answer_keeps_its_ids_as_text_and_writes_them_back_unchanged() -> None:
    answer = {"id": "c", "choices": [{"index": 0, "finish_reason": "length"}], KEY: IDS, "usage": {"prompt_tokens": 2000}}
    content = orjson.dumps(answer)
    data = loads_keeping_ints(content, KEY)
    assert isinstance(data[KEY], orjson.Fragment)
    assert orjson.dumps({"prompt_token_ids": data[KEY]}) == orjson.dumps({"prompt_token_ids": IDS})
    assert read(content) == answer


def test_an_id_too_long_for_64_bits_is_kept_as_written() -> None:
    # The check does not scan for digit runs: the generation worker reads the id as the context
    # worker wrote it (and refuses it), where a parse would have turned it into a float.
    array = b"[" + b",".join(str(i).encode() for i in IDS) + b",1234567890123456789012345]"
    data = loads_keeping_ints(b'{"prompt_token_ids":' + array + b"}", KEY)
    assert isinstance(data[KEY], orjson.Fragment)
    assert orjson.dumps(data) == b'{"prompt_token_ids":' + array + b"}"


@pytest.mark.parametrize(
    "body",
    [
        # Not the top-level value: a nested object of that name, a duplicate key (the last one wins).
        {"choices": [{KEY: IDS}]},
        # Shapes left to the ordinary parse: a zero, a negative, floats, an empty or short array.
        {KEY: [0, *IDS]},
        {KEY: [*IDS, -1]},
        {KEY: [*IDS, 1.5]},
        {KEY: []},
        {KEY: [1, 2, 3]},
        {KEY: [*IDS, 10**19]},
        {KEY: [*IDS, "x"]},
        {KEY: IDS, "other": [KEY]},
        # The placeholder's own value at the top, the array nested: not mistaken for each other.
        {KEY: 0, "x": {KEY: IDS}},
        {"x": {KEY: IDS}, KEY: 0},
    ],
)
def test_other_shapes_read_as_orjson_reads_them(body: dict[str, Any]) -> None:
    content = orjson.dumps(body)
    assert read(content) == orjson.loads(content)


@pytest.mark.parametrize(
    "content",
    [
        b'{"prompt_token_ids": [' + b", ".join(str(i).encode() for i in IDS) + b"]}",  # whitespace
        b'{"prompt_token_ids":[' + b",".join(str(i).encode() for i in IDS) + b'],"prompt_token_ids":[5]}',
        b'{"a":{"prompt_token_ids":[' + b",".join(str(i).encode() for i in IDS) + b"]}}",
        b'{"prompt_token_ids":[' + b",".join(str(i).encode() for i in IDS) + b",01]}",  # not JSON
        b'{"prompt_token_ids":[' + b",".join(str(i).encode() for i in IDS) + b",,3]}",
        # Too long for 64 bits: kept as written, read back by orjson as it reads the whole (a float).
        b'{"prompt_token_ids":[' + b",".join(str(i).encode() for i in IDS) + b",1234567890123456789012345]}",
        b'{"prompt_token_ids":[' + b",".join(str(i).encode() for i in IDS) + b"]",  # truncated
        b'["prompt_token_ids",[' + b",".join(str(i).encode() for i in IDS) + b"]]",
    ],
)
def test_hand_written_answers_read_as_orjson_reads_them_or_fail_as_it_does(content: bytes) -> None:
    try:
        expected = orjson.loads(content)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            read(content)
        return
    assert read(content) == expected


_items = st.one_of(
    st.integers(min_value=0, max_value=2**64 - 1), st.integers(min_value=-(2**63), max_value=-1), st.floats(allow_nan=False), st.text(max_size=3)
)


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=10**9), min_size=0, max_size=1500),
    extra=st.lists(_items, max_size=3),
    tail=st.dictionaries(st.sampled_from(["a", KEY, "usage"]), st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=5)), max_size=2),
    spaced=st.booleans(),
)
def test_any_answer_reads_as_orjson_reads_it(ids: list[int], extra: list[Any], tail: dict[str, Any], spaced: bool) -> None:
    body = {KEY: ids + extra, **tail}
    content = orjson.dumps(body)
    if spaced:
        content = content.replace(b",", b", ")
    assert read(content) == orjson.loads(content)
