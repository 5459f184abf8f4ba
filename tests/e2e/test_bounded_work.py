"""Bounded work per request, against a real gateway: more messages, content blocks or JSON objects
than allowed is a 413 in Anthropic's envelope; a large body is served (parsed on the large bodies'
thread) and the memory it took is given back afterwards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.cluster import Cluster, register_cluster, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.simworkers import SimWorker

LIMITS_ENV = {"MESSAGES_MAX_MESSAGES": "50", "MESSAGES_MAX_CONTENT_BLOCKS": "100", "MESSAGES_MAX_JSON_OBJECTS": "1000"}


@pytest.fixture
def make_cluster(transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker) -> Callable[[Gateway], Cluster]:
    def make(gateway: Gateway) -> Cluster:
        cluster = register_cluster(context_worker, generation_worker, schedule_style="generation_first")
        wait_registered(gateway, cluster)
        return cluster

    return make


def post(gateway: Gateway, cluster: Cluster, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": cluster.model, "max_tokens": 16, "messages": messages, **extra}
    return httpx.post(gateway.url + "/v1/messages", content=orjson.dumps(body), headers=cluster.headers(), timeout=60)


def assert_too_large(response: httpx.Response, words: str) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["type"] == "request_too_large" and words in error["message"], error


def test_too_many_messages_or_blocks_is_a_413(gateways: Callable[..., Gateway], make_cluster: Callable[[Gateway], Cluster]) -> None:
    gateway = gateways(**LIMITS_ENV)
    cluster = make_cluster(gateway)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(51)]
    assert_too_large(post(gateway, cluster, turns), "51 messages; the limit is 50")
    blocks = [{"type": "text", "text": "x"} for _ in range(101)]
    assert_too_large(post(gateway, cluster, [{"role": "user", "content": blocks}]), "101 content blocks; the limit is 100")
    # A tool result's own blocks count too.
    nested = [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "x"}] * 60}] * 2
    assert_too_large(post(gateway, cluster, [{"role": "user", "content": nested}]), "content blocks")
    assert post(gateway, cluster, [{"role": "user", "content": blocks[:100]}]).status_code == 200


def test_a_flood_of_tiny_objects_is_refused_before_it_is_parsed(gateways: Callable[..., Gateway], make_cluster: Callable[[Gateway], Cluster]) -> None:
    gateway = gateways(**LIMITS_ENV)
    cluster = make_cluster(gateway)
    blocks = [{"type": "text", "text": "x"} for _ in range(5000)]
    assert_too_large(post(gateway, cluster, [{"role": "user", "content": blocks}]), "5,002 JSON objects; the limit is 1,000")
    # Braces inside text are not objects: a prompt full of code is not refused for them.
    code = '{"' * 1200  # braces before quotes, inside a string: escaped there (\")
    accepted = post(gateway, cluster, [{"role": "user", "content": code}])
    assert accepted.status_code == 200, accepted.text


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_large_body_is_served_and_its_memory_given_back(gateways: Callable[..., Gateway], make_cluster: Callable[[Gateway], Cluster]) -> None:
    gateway = gateways(MESSAGES_OFFLOAD_BYTES="65536")
    cluster = make_cluster(gateway)
    assert gateway.process is not None
    small = post(gateway, cluster, [{"role": "user", "content": "warm up [sim tokens=2]"}])
    assert small.status_code == 200
    before = rss_mib(gateway.process.pid)
    # About 24 MB each: many mid-sized text blocks (the shape that took the most memory).
    blocks = [{"type": "text", "text": "word " * 400} for _ in range(12000)]
    for _ in range(3):
        response = post(gateway, cluster, [{"role": "user", "content": blocks + [{"type": "text", "text": "[sim tokens=2]"}]}])
        assert response.status_code in (200, 400), response.text  # 400: longer than the sim's context
    pid = gateway.process.pid
    peak = rss_mib(pid)
    # Given back shortly after the last request ends (messages_api/intake.py's release).
    wait_until(lambda: rss_mib(pid) - before < 64, timeout=10, message=f"RSS {before:.0f} → {peak:.0f} MiB, never back")
