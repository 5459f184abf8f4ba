"""The prompt serialized once (`RenderedChat`): worker bodies built from it are the bytes they were
when each body serialized the chat itself, and the token estimate counts the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from messages_api.convert import to_chat_request
from workers import protocols
from workers.models import ScheduleStyle
from workers.protocols import Call, ContextPeer, WorkerProtocol
from workers.schedule.prompt_tokens import estimate_prompt_tokens
from workers.schedule.rendered_chat import RenderedChat

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "claude_code_request.json"


def claude_code_chat() -> dict[str, Any]:
    body = json.loads(FIXTURE.read_text())["body"]
    return to_chat_request({**body, "model": "m", "max_tokens": 64, "stream": True})


def bodies(protocol: WorkerProtocol, chat: dict[str, Any]) -> list[dict[str, Any]]:
    """Every worker body the protocol builds straight from the chat (not those after a handoff)."""
    call = Call(request_id="req_1", conversation_id="conv")
    peer = ContextPeer(url="http://10.0.0.1:8001", options={"bootstrap_port": 8998}, info={})
    built = []
    for build in (
        lambda: protocol.aggregated_request(chat, call),
        lambda: protocol.context_request(chat, call, pair_id=7, schedule_style=ScheduleStyle.CONTEXT_FIRST, context=peer),
        lambda: protocol.generation_request_first(chat, call, pair_id=7, context=peer, schedule_style=ScheduleStyle.GENERATION_FIRST),
    ):
        try:
            built.append(build())
        except NotImplementedError:
            continue
    return built


@pytest.mark.parametrize("name", sorted(protocols.PROTOCOLS))
def test_every_protocols_bodies_are_the_same_bytes(name: str) -> None:
    chat = claude_code_chat()
    rendered = RenderedChat(chat)
    built = bodies(protocols.PROTOCOLS[name], chat)
    assert built and all(body["messages"] is chat["messages"] for body in built)  # the case that embeds
    assert [rendered.dumps(body) for body in built] == [orjson.dumps(body) for body in built]
    assert chat == claude_code_chat()  # the chat itself is left as it was


def test_a_body_with_its_own_messages_or_tools_is_serialized_as_it_is() -> None:
    """A protocol may rewrite the messages (tests/e2e/test_protocols.py's does): only the chat's own
    objects are taken from the rendering."""
    chat = claude_code_chat()
    rendered = RenderedChat(chat)
    rewritten = {**chat, "messages": [*chat["messages"][:-1], {"role": "user", "content": "changed"}]}
    assert rendered.dumps(rewritten) == orjson.dumps(rewritten)
    fewer_tools = {**chat, "tools": chat["tools"][:1]}
    assert rendered.dumps(fewer_tools) == orjson.dumps(fewer_tools)
    assert rendered.dumps({"model": "m"}) == b'{"model":"m"}'


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_chat = st.fixed_dictionaries(
    {"model": st.text(max_size=4)},
    optional={
        "messages": st.lists(st.dictionaries(st.text(max_size=8), _json, max_size=4), max_size=5),
        "tools": st.none() | st.lists(_json, max_size=4),
        "max_tokens": st.integers(1, 10**6),
    },
)


@settings(deadline=None)
@given(_chat)
def test_any_chat_serializes_to_the_same_bytes(chat: dict[str, Any]) -> None:
    rendered = RenderedChat(chat)
    assert rendered.dumps(chat) == orjson.dumps(chat)
    assert rendered.dumps({**chat, "stream": True}) == orjson.dumps({**chat, "stream": True})
    assert rendered.tools == orjson.dumps(chat.get("tools") or [])
    assert rendered.messages == [orjson.dumps(m) for m in chat.get("messages", [])]


@settings(deadline=None)
@given(st.lists(_json, max_size=6))
def test_the_estimate_counts_the_same_from_the_rendered_tools(tools: list[Any]) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert estimate_prompt_tokens(chat, tools_json=RenderedChat(chat).tools) == estimate_prompt_tokens(chat)


def test_the_estimate_of_claude_codes_request_is_unchanged() -> None:
    chat = claude_code_chat()
    assert estimate_prompt_tokens(chat, tools_json=RenderedChat(chat).tools) == estimate_prompt_tokens(chat) > 15_000
