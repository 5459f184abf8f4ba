"""bench/floor_proxy.py, the paced bench's floor of a Python relay, relays what a real client
expects: the pipe variants the worker's chat stream with its content intact, the reframe variants
an Anthropic stream the Anthropic SDK folds into the same text. Two requests each, so the pinned
keep-alive worker connection is reused. A floor that relayed a broken stream would still be
counted by the bench's byte pattern, so this is what keeps its figures honest."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.sdk import sdk_client, sdk_message
from tests.support.simworkers import SimWorker
from workers.sim.process import stop_process

FLOOR_PROXY = Path(__file__).resolve().parents[2] / "bench" / "floor_proxy.py"
PROMPT = "Hello [sim tokens=12]"


@pytest.fixture(params=["pipe", "reframe", "pipe-uvloop", "reframe-uvloop"])
def floor(request: pytest.FixtureRequest, generation_worker: SimWorker) -> Iterator[tuple[str, str]]:
    """(mode, base URL) of a floor proxy in front of the generation sim."""
    mode, _, loop = str(request.param).partition("-")
    command = [sys.executable, str(FLOOR_PROXY), "--mode", mode, "--upstream", generation_worker.url]
    if loop:
        command.append("--uvloop")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()  # ends at the listening line, or empty if it died
        assert " listening on " in line, f"floor proxy did not start: {line!r}"
        if loop:
            assert "(uvloop)" in line, line
        yield mode, line.strip().rsplit(" ", 1)[1]
    finally:
        stop_process(process)


def chat_contents(client: httpx.Client, base_url: str) -> list[str]:
    """The content deltas of one streamed chat request, in order."""
    body = {"model": "sim-model", "max_tokens": 1000, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    contents: list[str] = []
    with client.stream("POST", base_url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in orjson.loads(line[6:])["choices"]:
                    if choice["delta"].get("content"):
                        contents.append(choice["delta"]["content"])
    return contents


def test_floor_relays_the_stream(floor: tuple[str, str], generation_worker: SimWorker) -> None:
    mode, url = floor
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        direct = chat_contents(client, generation_worker.url)
        assert len(direct) == 12
        if mode == "pipe":
            for _ in range(2):
                assert chat_contents(client, url) == direct
            return
    with sdk_client(url, "unused", timeout=10.0) as sdk:
        for _ in range(2):
            events: list[Any] = []
            message = sdk_message(sdk, True, events=events, model="sim-model", max_tokens=1000,
                                  messages=[{"role": "user", "content": PROMPT}])
            deltas = [event.delta.text for event in events
                      if event.type == "content_block_delta" and event.delta.type == "text_delta"]
            assert deltas == direct
            assert message.stop_reason == "end_turn"
            assert message.usage.output_tokens == 12
            assert [block.type for block in message.content] == ["text"]
