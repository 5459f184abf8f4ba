"""Bounded work per request, in-process: a large body is parsed on the large bodies' thread and a
small one in place; objects are counted before parsing."""

from __future__ import annotations

import os
import threading

import orjson
import pytest
from django.test import override_settings

from messages_api import intake
from messages_api.cache_accounting import cached_prefix_share
from messages_api.errors import AnthropicError


def body(blocks: int, text: str = "x") -> bytes:
    content = [{"type": "text", "text": text} for _ in range(blocks)]
    return orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]})


async def thread_of(raw: bytes, monkeypatch: pytest.MonkeyPatch) -> str:
    seen: list[str] = []
    validate = intake.validate_messages_request

    def recording(parsed: object) -> dict[str, object]:
        seen.append(threading.current_thread().name)
        return validate(parsed)

    monkeypatch.setattr(intake, "validate_messages_request", recording)
    request, chat, rendered, cache_share = await intake.messages_request(raw)
    assert request["model"] == "m" and chat["messages"] and rendered.estimated_prompt_tokens() > 0 and cache_share == 0.0
    return seen[0]


@override_settings(MESSAGES_OFFLOAD_BYTES=10_000)
async def test_a_large_body_is_handled_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (await thread_of(body(2), monkeypatch)) == threading.current_thread().name
    assert (await thread_of(body(20, "y" * 1000), monkeypatch)).startswith("large-bodies")


@override_settings(MESSAGES_OFFLOAD_BYTES=10_000)
async def test_a_large_bodys_cache_breakpoint_is_found_off_the_event_loop() -> None:
    # The breakpoint's share of the body is computed with the rest of the body's preparation.
    content = [{"type": "text", "text": "y" * 1000} for _ in range(20)]
    content[9]["cache_control"] = {"type": "ephemeral"}  # type: ignore[assignment]
    raw = orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]})
    prepared = await intake.messages_request(raw)
    assert prepared.cache_share == pytest.approx(cached_prefix_share(prepared.request, len(raw)))
    assert 0.4 < prepared.cache_share < 0.6
    assert (await intake.messages_request(body(20, "y" * 1000))).cache_share == 0.0


@override_settings(MESSAGES_OFFLOAD_BYTES=10_000, MESSAGES_ISOLATE_BYTES=100_000)
async def test_the_largest_bodies_are_prepared_in_a_process_of_their_own() -> None:
    """Its answer is the thread's, errors come back as themselves, and a dead process is replaced
    (that body prepared on the thread meanwhile)."""
    raw = body(20, "z" * 10_000)
    expected = intake._prepare_message(raw)
    request, chat, rendered, cache_share = await intake.messages_request(raw)
    assert (request, chat, cache_share) == (expected.request, expected.chat, expected.cache_share)
    assert rendered.messages == expected[2].messages and rendered.estimated_prompt_tokens() == expected[2].estimated_prompt_tokens()
    assert intake._isolated is not None
    [child] = intake._isolated._processes.values()  # type: ignore[attr-defined]
    assert child.pid != os.getpid()

    bad = orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "robot", "content": "x" * 200_000}]})
    with pytest.raises(AnthropicError) as refused:
        await intake.messages_request(bad)
    assert refused.value.status == 400 and "messages.0.role" in refused.value.message

    child.kill()
    child.join()
    request, *_ = await intake.messages_request(raw)  # the broken pool: the thread answers
    assert request == expected[0] and intake._isolated is None
    await intake.messages_request(raw)  # and the next large body starts another process
    assert intake._isolated is not None
    intake._isolated.shutdown()
    intake._isolated = None


@override_settings(MESSAGES_MAX_JSON_OBJECTS=10)
async def test_objects_are_counted_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake.orjson, "loads", lambda raw: pytest.fail("parsed"))
    with pytest.raises(AnthropicError) as refused:
        await intake.messages_request(body(10))
    assert refused.value.status == 413 and "12 JSON objects" in refused.value.message


async def test_invalid_json_is_a_400() -> None:
    with pytest.raises(AnthropicError) as refused:
        await intake.messages_request(b'{"model": ')
    assert refused.value.status == 400 and refused.value.message.startswith("The request body is not valid JSON")
