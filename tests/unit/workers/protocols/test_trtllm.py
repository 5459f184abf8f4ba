"""TensorRT-LLM's handoff: the prompt's token ids its context answer carries, read for the KV-event
join in each form the worker may send them (a list, the JSON text the gateway relays unread,
upstream's base64 int32 buffer)."""

from __future__ import annotations

import base64
import struct

import orjson
from hypothesis import given
from hypothesis import strategies as st

from workers.protocols.trtllm import ContextResult, read_context_response
from workers.protocols.vllm import PrefillResult
from workers.wire.raw_ints import loads_keeping_ints

PARAMS = {"ctx_request_id": 7, "disagg_request_id": 7, "opaque_state": "x"}


def answer(**fields: object) -> dict[str, object]:
    return {"choices": [{"index": 0, "finish_reason": "length", "disaggregated_params": PARAMS}], **fields}


@given(st.lists(st.integers(min_value=1, max_value=2**31 - 1), min_size=1, max_size=3000))
def test_the_prompt_ids_are_read_back_from_every_form(ids: list[int]) -> None:
    as_list = read_context_response(answer(prompt_token_ids=ids))
    as_text = read_context_response(loads_keeping_ints(orjson.dumps(answer(prompt_token_ids=ids)), "prompt_token_ids"))
    b64 = base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()
    as_b64 = read_context_response(answer(prompt_token_ids_b64=b64))
    for result in (as_list, as_text, as_b64):
        reader = result.prompt_ids_reader
        assert reader is not None and reader() == ids


def test_no_reader_without_ids_or_handoff() -> None:
    assert read_context_response(answer()).prompt_ids_reader is None
    finished = {"choices": [{"index": 0, "finish_reason": "stop", "disaggregated_params": PARAMS}], "prompt_token_ids": [1, 2]}
    assert read_context_response(finished).prompt_ids_reader is None  # answered in full: no handoff, no ids kept
    assert ContextResult(PARAMS, None, None, None).prompt_ids_reader is None
    assert PrefillResult(None, 3).prompt_ids_reader is None
