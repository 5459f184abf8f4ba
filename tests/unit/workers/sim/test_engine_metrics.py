"""The simulated worker publishes its load as each engine does, and the gateway's reader of that
engine reads it: its own queue and running requests, its prefix cache's use, and outside load."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from workers.protocols import PROTOCOLS
from workers.protocols.engine_load import EngineLoad
from workers.sim.app import SimApp
from workers.sim.config import SimConfig


def client(app: SimApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")


@pytest.mark.parametrize("protocol", ["vllm", "sglang", "trtllm"])
async def test_each_dialect_publishes_what_the_gateway_reads(protocol: str) -> None:
    app = SimApp(SimConfig(role="generation", protocol=protocol, model="m", outside_waiting=4, outside_running=1))
    reader = PROTOCOLS[protocol]
    assert reader.metrics_path is not None
    async with client(app) as sim:
        answer = await sim.get(reader.metrics_path)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
        assert reader.read_load(answer.text, "m") == EngineLoad(waiting=4, running=1, kv_usage=0.0)
        assert (await sim.post("/sim/outside_load", json={"waiting": 50, "running": 0, "kv_usage": 0.97})).status_code == 200
        assert reader.read_load((await sim.get(reader.metrics_path)).text, "m") == EngineLoad(waiting=50, running=0, kv_usage=0.97)
        assert (await sim.get("/sim/stats")).json()["metrics_reads"] == 2


async def test_a_plain_openai_sim_has_no_metrics() -> None:
    async with client(SimApp(SimConfig(role="generation", protocol="openai"))) as sim:
        assert (await sim.get("/metrics")).status_code == 404


async def test_its_own_queue_running_requests_and_cache_are_reported() -> None:
    app = SimApp(SimConfig(
        role="generation", protocol="vllm", model="m", prefill_concurrency=1, prefill_tokens_per_second=2000,
        tokens_per_second=0, kv_block_tokens=16, kv_cache_blocks=64,
    ))  # fmt: skip
    reader = PROTOCOLS["vllm"]
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "word " * 400}]}
    async with client(app) as sim:
        chats = [asyncio.create_task(sim.post("/v1/chat/completions", json=body)) for _ in range(3)]
        while app.stats.active < 3:
            await asyncio.sleep(0.01)
        busy = reader.read_load((await sim.get("/metrics")).text, "m")
        assert busy is not None and busy.requests == 3 and busy.waiting >= 1
        await asyncio.gather(*chats)
        idle = reader.read_load((await sim.get("/metrics")).text, "m")
    assert idle is not None and idle.requests == 0
    assert idle.kv_usage is not None and 0 < idle.kv_usage <= 1  # the prompt's blocks are held


async def test_the_metrics_route_can_be_made_to_fail() -> None:
    async with client(SimApp(SimConfig(role="generation", protocol="trtllm"))) as sim:
        assert (await sim.post("/sim/outside_load", json={"metrics_status": 503})).status_code == 200
        assert (await sim.get("/prometheus/metrics")).status_code == 503
        for bad in ({"waiting": -1}, {"kv_usage": 2}, {"metrics_status": 302}, []):
            assert (await sim.post("/sim/outside_load", json=bad)).status_code == 400
