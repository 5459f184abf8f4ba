"""disagg_project/daphne.py: the gateway runs on uvloop when started through its launcher (as
`manage.py serve`, the benchmarks and these tests start it), on asyncio's own loop with
GATEWAY_UVLOOP=0; either way it streams, and sees a client leave."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import register_cluster, wait_registered
from tests.gateway import PROJECT_ROOT, Gateway, gateway_env
from tests.simworkers import SimWorker


def event_loop_of(gateway: Gateway) -> str:
    metrics = httpx.get(gateway.url + "/metrics").text
    match = re.search(r'^gateway_event_loop_info\{loop="([^"]+)"\} 1\.0$', metrics, re.M)
    assert match, "no gateway_event_loop_info in /metrics"
    return match.group(1)


@pytest.mark.parametrize(("flag", "loop"), [(None, "uvloop.Loop"), ("0", "asyncio.unix_events._UnixSelectorEventLoop")])
def test_the_gateway_runs_on_the_loop_the_flag_chooses(
    transactional_db: Any,
    gateways: Callable[..., Gateway],
    context_worker: SimWorker,
    generation_worker: SimWorker,
    flag: str | None,
    loop: str,
) -> None:
    gateway = gateways(**({"GATEWAY_UVLOOP": flag} if flag is not None else {}))
    assert event_loop_of(gateway) == loop
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    body = {"model": cluster.model, "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "hi [sim tokens=5]"}]}
    with httpx.stream("POST", gateway.url + "/v1/messages", json=body, headers=cluster.headers(), timeout=30) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    assert text.count("event: content_block_delta") == 5
    assert text.rstrip().endswith('data: {"type":"message_stop"}')


def test_the_launcher_sets_uvloop_before_daphne_installs_its_reactor() -> None:
    # daphne creates its loop when `daphne.server` is imported: the launcher must come first.
    probe = (
        "import sys; from disagg_project import daphne as launcher; launcher.use_uvloop(); "
        "import daphne.server; from twisted.internet import reactor; "
        "print(type(reactor._asyncioEventloop).__module__)"
    )
    for flag, expected in (("1", "uvloop"), ("0", "asyncio.unix_events")):
        env = gateway_env({"GATEWAY_UVLOOP": flag})
        out = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected
