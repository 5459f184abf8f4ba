"""The Message Batches shapes without a database: the create body checked whole, the batch object,
the list's paging query (messages_api/batches/schema.py)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any

import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from messages_api.batches.schema import (
    CUSTOM_ID,
    BatchView,
    PageQuery,
    batch_object,
    deleted_object,
    new_batch_id,
    page_query,
    parse_create_body,
)
from messages_api.errors import AnthropicError

MODEL = "claude-test"


def params(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **extra}


def body(requests: Any) -> bytes:
    return orjson.dumps({"requests": requests})


def refused(raw: bytes, may_use: Any = lambda model: True) -> str:
    with pytest.raises(AnthropicError) as caught:
        parse_create_body(raw, may_use)
    assert caught.value.status == 400 and caught.value.error_type == "invalid_request_error"
    return caught.value.message


def test_items_keep_their_params_and_order() -> None:
    items = parse_create_body(body([{"custom_id": "a", "params": params()}, {"custom_id": "b-2_", "params": params(system="s")}]), lambda m: True)
    assert [i.custom_id for i in items] == ["a", "b-2_"]
    assert orjson.loads(items[1].params) == params(system="s")


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([], "requests: List should have at least 1 item after validation, not 0"),
        ("x", "requests: Input should be a valid list"),
        ([1], "requests.0: Input should be a valid dictionary"),
        ([{"params": params()}], "requests.0.custom_id: Field required"),
        ([{"custom_id": 7, "params": params()}], "requests.0.custom_id: Input should be a valid string"),
        ([{"custom_id": "", "params": params()}], "requests.0.custom_id: String should match pattern"),
        ([{"custom_id": "a b", "params": params()}], "requests.0.custom_id: String should match pattern"),
        ([{"custom_id": "a" * 65, "params": params()}], "requests.0.custom_id: String should match pattern"),
        ([{"custom_id": "a", "params": params()}, {"custom_id": "a", "params": params()}], "requests.1.custom_id: Duplicate custom_id 'a'"),
        ([{"custom_id": "a"}], "requests.0.params: Field required"),
        ([{"custom_id": "a", "params": params()}, {"custom_id": "b", "params": {"model": MODEL}}], "requests.1.params.max_tokens: Field required"),
        ([{"custom_id": "a", "params": params(max_tokens=0)}], "requests.0.params.max_tokens: Input should be greater than or equal to 1"),
        ([{"custom_id": "a", "params": params(stream=True)}], "requests.0.params.stream: Streaming is not supported"),
        (
            [{"custom_id": "a", "params": params(messages=[{"role": "user", "content": [{"type": "nope"}]}])}],
            "requests.0.params.messages.0.content.0.type",
        ),
    ],
)
def test_refused_whole_naming_the_item(requests: Any, message: str) -> None:
    assert refused(body(requests)).startswith(message)


def test_refusals_of_the_body_itself() -> None:
    assert refused(b"{").startswith("The request body is not valid JSON")
    assert refused(b"[]") == "The request body must be a JSON object"
    assert refused(b"{}") == "requests: Field required"


def test_stream_false_is_accepted() -> None:
    assert len(parse_create_body(body([{"custom_id": "a", "params": params(stream=False)}]), lambda m: True)) == 1


def test_a_model_the_key_may_not_use(settings: Any) -> None:
    message = refused(body([{"custom_id": "a", "params": params()}, {"custom_id": "b", "params": params(model="secret")}]), lambda m: m != "secret")
    assert message == "requests.1.params.model: this API key may not use the model 'secret'"


def test_too_many_requests(settings: Any) -> None:
    settings.BATCH_MAX_REQUESTS = 2
    requests = [{"custom_id": f"i{n}", "params": params()} for n in range(3)]
    assert refused(body(requests)) == "requests: List should have at most 2 items after validation, not 3"


@given(st.text(max_size=70))
@example("0\n")  # a final newline: `$` let it through once, and hypothesis finds it only by luck
def test_a_custom_id_is_taken_exactly_when_anthropics_pattern_matches_it_whole(custom_id: str) -> None:
    # A final newline once passed (`$` matches before it) and broke the results' JSON line.
    allowed = re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", custom_id) is not None
    assert (CUSTOM_ID.fullmatch(custom_id) is not None) == allowed
    raw = body([{"custom_id": custom_id, "params": params()}])
    if allowed:
        assert [item.custom_id for item in parse_create_body(raw, lambda model: True)] == [custom_id]
    else:
        assert refused(raw).startswith("requests.0.custom_id")


def test_batch_ids() -> None:
    ids = {new_batch_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"msgbatch_[A-Za-z0-9]{24}", i) for i in ids)


NOW = datetime(2026, 12, 6, 12, 0, 0, 123456, tzinfo=timezone.utc)


def view(**fields: Any) -> BatchView:
    base: dict[str, Any] = {
        "batch_id": "msgbatch_x", "processing_status": "in_progress", "created_at": NOW, "expires_at": NOW + timedelta(days=1),
        "ended_at": None, "cancel_initiated_at": None, "archived_at": None,
        "total": 5, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0,
    }
    return BatchView(**{**base, **fields})


def test_batch_object_in_progress() -> None:
    assert batch_object(view()) == {
        "id": "msgbatch_x",
        "type": "message_batch",
        "processing_status": "in_progress",
        "request_counts": {"processing": 5, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0},
        "ended_at": None,
        "created_at": "2026-12-06T12:00:00.123456Z",
        "expires_at": "2026-12-07T12:00:00.123456Z",
        "archived_at": None,
        "cancel_initiated_at": None,
        "results_url": None,
    }


def test_batch_object_counts_only_once_ended() -> None:
    canceling = batch_object(view(processing_status="canceling", cancel_initiated_at=NOW, succeeded=1, canceled=2))
    assert canceling["request_counts"] == {"processing": 5, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    assert canceling["results_url"] is None and canceling["cancel_initiated_at"] == "2026-12-06T12:00:00.123456Z"
    done = batch_object(view(processing_status="ended", ended_at=NOW, succeeded=2, errored=1, canceled=1, expired=1))
    assert done["request_counts"] == {"processing": 0, "succeeded": 2, "errored": 1, "canceled": 1, "expired": 1}
    assert done["results_url"] == "/v1/messages/batches/msgbatch_x/results"
    archived = batch_object(view(processing_status="ended", ended_at=NOW, archived_at=NOW, succeeded=5))
    assert archived["results_url"] is None and archived["archived_at"] is not None


@given(st.sampled_from(["in_progress", "canceling", "ended"]), st.lists(st.integers(0, 50), min_size=4, max_size=4))
def test_counts_always_sum_to_the_batch_size(status: str, parts: list[int]) -> None:
    succeeded, errored, canceled, expired = parts
    total = sum(parts)
    counts = batch_object(
        view(processing_status=status, total=total, succeeded=succeeded, errored=errored, canceled=canceled, expired=expired)
    )["request_counts"]
    assert sum(counts.values()) == total


def test_timestamps_are_utc_with_z() -> None:
    other_zone = timezone(timedelta(hours=2))
    assert batch_object(view(created_at=NOW.astimezone(other_zone)))["created_at"] == "2026-12-06T12:00:00.123456Z"


def test_deleted_object() -> None:
    assert deleted_object("msgbatch_x") == {"id": "msgbatch_x", "type": "message_batch_deleted"}


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({}, PageQuery(20)),
        ({"limit": ["1"]}, PageQuery(1)),
        ({"limit": ["1000"], "after_id": ["msgbatch_a"]}, PageQuery(1000, after_id="msgbatch_a")),
        ({"before_id": ["msgbatch_b"]}, PageQuery(20, before_id="msgbatch_b")),
    ],
)
def test_page_query(query: dict[str, list[str]], expected: PageQuery) -> None:
    assert page_query(query) == expected


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"limit": ["0"]}, "limit: Input should be between 1 and 1000"),
        ({"limit": ["1001"]}, "limit: Input should be between 1 and 1000"),
        ({"limit": ["x"]}, "limit: Input should be a valid integer"),
        ({"after_id": ["a"], "before_id": ["b"]}, "Only one of after_id and before_id may be given"),
    ],
)
def test_page_query_refusals(query: dict[str, list[str]], message: str) -> None:
    with pytest.raises(AnthropicError, match=re.escape(message)):
        page_query(query)
