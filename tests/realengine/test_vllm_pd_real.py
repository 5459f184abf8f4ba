"""Prefill/decode disaggregation on two real vLLM servers through the gateway's `vllm` pool.

The prefill server (the pool's context endpoint) answers the prompt with one token and the
`kv_transfer_params` of the KV blocks it holds; the gateway sends the same prompt, streamed, to the
decode server (the generation endpoint) with those params, and the decode server pulls the blocks
over NIXL (NixlConnector on the CPU, through UCX) instead of prefilling. Both servers are started
as `bench/pd_vllm.py --no-progress-thread` starts them (tests/support/realvllm/pd.py): with NIXL's
busy-polling progress thread on, each idle server spins a core and on these 2 cores 4 of 5
decodes stalled 13-33 s; without it, every decode in the benchmark started within ~1 s.

The module runs after every other test (`runs_last`, tests/conftest.py) and stops the shared server
first: the pair alone peaks at 3.5 GB (bench/vllm_memory.py --pair), three servers at once would
pass the real-engine part's 4 GB budget, and the pair's start and stop stall this 2-core machine
for seconds.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.support.cluster import audit_row, reservations_closed, wait_registered
from tests.support.gateway import Gateway
from tests.support.rawclient import RawStream
from tests.support.realvllm.pd import LATE_READ, NO_KV_TRANSFER, prompt, require_nixl, start_pair
from tests.support.realvllm.server import RealVllm, stop_shared

pytestmark = pytest.mark.runs_last

STREAM_EVENTS = re.compile(r"^message_start content_block_start (content_block_delta )+content_block_stop message_delta message_stop$")


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[RealVllm, RealVllm]]:
    require_nixl()
    stop_shared()
    prefill, decode = start_pair(progress_thread=False)
    try:
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture
def pd_pool(pair: tuple[RealVllm, RealVllm], transactional_db: Any, gateway: Gateway) -> SimpleNamespace:
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    prefill, decode = pair
    pool = WorkerPool.objects.create(
        name="real-vllm-pd", model=prefill.model, schedule_style="context_first", protocol="vllm"
    )
    WorkerEndpoint.objects.create(pool=pool, role="context", url=prefill.url)
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=decode.url)
    _, key = create_api_key(f"real-vllm-pd-{time.monotonic_ns()}")
    namespace = SimpleNamespace(pool=pool, key=key, prefill=prefill, decode=decode)
    wait_registered(gateway, namespace)  # type: ignore[arg-type]  # reads only .pool
    return namespace


def generated(engine: RealVllm) -> float:
    return engine.metrics().get("vllm:generation_tokens_total", 0.0)


def test_prefilled_on_one_server_decoded_on_the_other(gateway: Gateway, pd_pool: SimpleNamespace) -> None:
    prefill, decode = pd_pool.prefill, pd_pool.decode
    before = {"prefill": generated(prefill), "decode": generated(decode)}
    messages = [{"role": "user", "content": prompt(0)}]
    headers = {"x-api-key": pd_pool.key, "anthropic-version": "2023-06-01", "content-type": "application/json"}
    body = {"model": prefill.model, "max_tokens": 8, "temperature": 0, "stream": True, "messages": messages}

    stream = RawStream.post_json(gateway.url + "/v1/messages", body, headers)
    frames = stream.read_all(timeout=120)
    names = " ".join(f.event for f in frames if f.event != "ping")
    assert STREAM_EVENTS.match(names), names
    delta = next(f.data for f in frames if f.event == "message_delta")
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 8

    # The prompt, as the engine counts it, is what the client is told it sent.
    counted = httpx.post(
        prefill.url + "/tokenize", json={"model": prefill.model, "messages": messages, "add_generation_prompt": True}, timeout=30
    ).json()["count"]
    start = next(f.data for f in frames if f.event == "message_start")
    assert start["message"]["usage"]["input_tokens"] == counted

    # One token on the prefill server (the gateway's max_tokens=1 leg), the answer on the decode
    # server, which took the KV over NIXL: it never logged that it would prefill by itself, and
    # the prefill server saw no read after its blocks' lease.
    assert generated(prefill) - before["prefill"] == 1
    assert generated(decode) - before["decode"] == 8
    assert NO_KV_TRANSFER not in decode.log_path.read_text(errors="replace"), decode.log_tail()
    assert LATE_READ not in prefill.log_path.read_text(errors="replace"), prefill.log_tail()

    request_id = stream.response_headers["request-id"]
    assert audit_row(request_id).status == "completed"
    assert {r.stage: r.outcome for r in reservations_closed(request_id)} == {"context": "success", "generation": "success"}
