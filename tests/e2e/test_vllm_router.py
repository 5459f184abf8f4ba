"""The gateway's vLLM protocol against software we did not write: vllm-router (PyPI
`vllm-router`, vllm-project/router) in its vLLM prefill/decode mode, in front of the same
vLLM-dialect sim workers. The same chat request goes through both (OpenAI chat to the router,
Anthropic Messages to the gateway) and the legs each sim received must carry the same protocol
fields, in the same order.

The router must not reach outside the machine: every proxy variable points at a trap that records
any connection, local addresses bypass it, and the test fails if the trap saw anything.

Without the binary the test skips, except under `REQUIRE_VLLM_ROUTER=1` (CI), where it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster import register_cluster, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.ports import unused_port
from tests.support.rawclient import RawStream
from tests.support.scripted import ScriptedServer
from tests.support.simworkers import SimWorker
from workers.sim.process import stop_process

pytestmark = pytest.mark.django_db(transaction=True)

ROUTER_VERSION = "0.1.17"
# Ids and addresses differ between the two runs by nature; everything else must be equal.
VARYING_PARAMS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids", "remote_num_tokens")
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
PROMPT = "Compare the legs [sim tokens=5]"


def router_binary() -> str:
    found = shutil.which("vllm-router") or shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    if found:
        return found
    reason = f"vllm-router is not installed (pip install vllm-router=={ROUTER_VERSION})"
    if os.environ.get("REQUIRE_VLLM_ROUTER") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


class OutboundTrap:
    """A listener every proxy variable points at: what connects to it tried to leave the host."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.server = ScriptedServer(self._record).start_thread()
        self.url = self.server.url

    async def _record(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        index = len(self.seen)
        self.seen.append(b"(connected, sent nothing)")  # recorded at once, even if the trap closes now
        with contextlib.suppress(TimeoutError, ConnectionError):
            self.seen[index] = await asyncio.wait_for(reader.read(512), 2)  # the request line names where it wanted to go

    def close(self) -> None:
        self.server.stop_thread()


class Router:
    """vllm-router in PD mode in front of one prefill and one decode worker."""

    def __init__(self, prefill: str, decode: str, trap: OutboundTrap, log: Path) -> None:
        self.port = unused_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env[name] = env[name.lower()] = trap.url
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        env["HF_HUB_OFFLINE"] = "1"
        command = [
            router_binary(), "--vllm-pd-disaggregation",
            "--prefill", prefill, "--decode", decode,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(unused_port()),
            # A policy that needs no tokenizer; startup checks every second, not every 30.
            "--policy", "round_robin", "--worker-startup-check-interval", "1",
        ]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.process.poll() is None, f"vllm-router exited: {self.log.read_text()[-2000:]}"
            try:
                return httpx.get(self.url + "/health", timeout=1, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=30, interval=0.1, message="vllm-router never became healthy")

    def stop(self) -> None:
        stop_process(self.process, grace=5.0)


@pytest.fixture
def vllm_pair(sim_pair: Callable[..., tuple[SimWorker, SimWorker]]) -> tuple[SimWorker, SimWorker]:
    pair: tuple[SimWorker, SimWorker] = sim_pair("vllm")
    return pair


@pytest.fixture
def router(vllm_pair: tuple[SimWorker, SimWorker], tmp_path: Path) -> Iterator[Router]:
    trap = OutboundTrap()
    running = Router(vllm_pair[0].url, vllm_pair[1].url, trap, tmp_path / "vllm-router.log")
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()
        trap.close()
    assert trap.seen == [], f"vllm-router tried to reach outside: {trap.seen}"


def legs(worker: SimWorker) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = httpx.get(worker.url + "/sim/requests?headers=1", timeout=5, trust_env=False).json()
    return entries


def protocol_view(entry: dict[str, Any]) -> dict[str, Any]:
    """What the vLLM protocol decides about one leg, ids and addresses masked."""
    body = entry["body"]
    params = body.get("kv_transfer_params")
    if isinstance(params, dict):
        params = {k: ("<set>" if k in VARYING_PARAMS and v is not None else v) for k, v in params.items()}
    return {
        "model": body.get("model"),
        "max_tokens": body.get("max_tokens"),
        "max_completion_tokens": body.get("max_completion_tokens"),
        "min_tokens": body.get("min_tokens"),
        "stream": body.get("stream"),
        "stream_options": "stream_options" in body,
        "kv_transfer_params": params,
    }


def run_legs(context: SimWorker, generation: SimWorker) -> list[dict[str, Any]]:
    """The legs of one request in call order: the prefill's, then the decode's (which pulled
    the KV the prefill issued, so it came after it)."""
    [prefill] = legs(context)
    [decode] = legs(generation)
    pulled = decode["body"]["kv_transfer_params"]["remote_request_id"]
    assert context.stats()["kv_taken"] == 1 and pulled.startswith("chatcmpl-sim-")
    request_id = prefill["headers"].get("x-request-id")
    assert request_id and decode["headers"] == {"x-request-id": request_id}, (prefill["headers"], decode["headers"])
    return [prefill, decode]


def test_the_gateway_sends_what_vllm_router_sends(
    transactional_db: Any, gateway: Gateway, router: Router, vllm_pair: tuple[SimWorker, SimWorker]
) -> None:
    context, generation = vllm_pair

    context.reset()
    generation.reset()
    chat = {
        "model": "sim-model",
        "max_tokens": 64,
        "stream": True,
        "stream_options": STREAM_OPTIONS,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=chat, timeout=30, trust_env=False) as response:
        assert response.status_code == 200, response.read()
        data = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    text = "".join((json.loads(d)["choices"] or [{}])[0].get("delta", {}).get("content") or "" for d in data[:-1])
    assert text
    through_router = run_legs(context, generation)

    cluster = register_cluster(context, generation, protocol="vllm")  # resets both sims
    wait_registered(gateway, cluster)
    s = RawStream.post_json(
        gateway.url + "/v1/messages",
        {"model": cluster.model, "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": PROMPT}]},
        cluster.headers(),
    )
    frames = s.read_all()
    assert s.status == 200 and frames[-1].event == "message_stop", s.events()
    assert "".join(f.data["delta"].get("text", "") for f in frames if f.event == "content_block_delta") == text
    through_gateway = run_legs(context, generation)
    assert through_gateway[0]["headers"] == {"x-request-id": s.response_headers["request-id"]}

    assert [protocol_view(leg) for leg in through_gateway] == [protocol_view(leg) for leg in through_router]
    # The prompt reached both legs the same way through both.
    assert through_gateway[0]["body"]["messages"] == through_gateway[1]["body"]["messages"]
    assert through_router[0]["body"]["messages"] == through_router[1]["body"]["messages"]
