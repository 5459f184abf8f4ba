"""bench/framework_floor.py, the floor of a request on daphne and Channels, answers what a real
client expects in each of its modes: a streamed and a non-streamed message the Anthropic SDK
reads, the relay mode with the generation worker's text. A floor that did less than a real
answer would make the gateway's share of `bench/request_cpu.py --floors` look larger than it is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support.gateway import Gateway
from tests.support.sdk import sdk_client, sdk_message
from tests.support.simworkers import SimWorker

PROMPT = "Hello [sim tokens=6]"


@pytest.fixture(params=["stock", "answer", "relay", "relay-aiohttp"])
def floor(request: pytest.FixtureRequest, generation_worker: SimWorker) -> Iterator[tuple[str, str]]:
    """(mode, base URL) of daphne serving the floor application in that mode."""
    mode = str(request.param)
    env = {"FRAMEWORK_FLOOR": mode, "FLOOR_UPSTREAM": generation_worker.url}
    quiet = [] if mode == "stock" else ["-v", "0"]
    with Gateway(env, daphne_args=quiet, application="bench.framework_floor:application") as server:
        yield mode, server.url


def worker_text(base_url: str) -> list[str]:
    """The content deltas of one streamed chat request straight to the worker, in order."""
    body = {"model": "sim-model", "max_tokens": 100, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    contents: list[str] = []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=10.0, trust_env=False) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                contents.extend(c["delta"]["content"] for c in orjson.loads(line[6:])["choices"] if c["delta"].get("content"))
    return contents


def test_each_floor_answers_as_the_sdk_expects(floor: tuple[str, str], generation_worker: SimWorker) -> None:
    mode, url = floor
    expected = worker_text(generation_worker.url) if mode.startswith("relay") else ["a", " b", " c", " d"]
    assert len(expected) == (6 if mode.startswith("relay") else 4)
    with sdk_client(url, "unused", timeout=10.0) as sdk:
        for _ in range(2):  # the second on a kept-alive connection (and, relaying, a pooled worker one)
            events: list[Any] = []
            streamed = sdk_message(sdk, True, events=events, model="sim-model", max_tokens=100,
                                   messages=[{"role": "user", "content": PROMPT}])
            deltas = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
            assert deltas == expected
            assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
            assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
            assert streamed.usage.output_tokens == len(expected)
            whole = sdk_message(sdk, False, model="sim-model", max_tokens=100, messages=[{"role": "user", "content": PROMPT}])
            assert [block.type for block in whole.content] == ["text"]
            assert whole.content[0].text == "".join(expected)  # type: ignore[union-attr]
            assert whole.usage.output_tokens == len(expected)
