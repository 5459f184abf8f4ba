"""A request's way to its first body bytes crosses few event-loop turns.

Under a burst each turn of the loop is a pass over all the work that is ready (every other
stream's arrivals, tokens and endings), so every task hop on the start path costs each request of
the burst one such pass (bench/loop_turns.py, bench/results/2026-12-06-framework-floor.md). The
gateway here runs wrapped in bench/loop_turns_app.py, which counts the turns from daphne's
`WebRequest.process` to the response's first `write`.

The bound is on the fewest turns a request took, not the typical: a timer of the gateway's own
(the loop-lag monitor) that fires while the worker answers adds a turn to that request, more
often on a loaded machine. With the request, its pipeline and its generation request each in a
task of its own, no request took fewer than 9; the one left on the path is aiohttp's, which
writes a request's body from a task (on Python 3.11; 3.12 starts it at once).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster import register_cluster, wait_registered
from tests.support.gateway import PROJECT_ROOT, Gateway
from tests.support.simworkers import SimWorker

FEWEST_TURNS = 5


@pytest.fixture
def counted(transactional_db: Any, tmp_path: Path) -> Iterator[tuple[Gateway, Path]]:
    out = tmp_path / "turns.json"
    env = {
        "LOOP_TURNS_APP": "disagg_project.asgi:application",
        "LOOP_TURNS_OUT": str(out),
        "PYTHONPATH": str(PROJECT_ROOT / "bench"),
    }
    with Gateway(env, application="loop_turns_app:application") as gateway:
        yield gateway, out


def take_samples(gateway: Gateway, out: Path) -> list[int]:
    """The counts since the last call (SIGUSR2 writes them and starts afresh)."""
    assert gateway.process is not None
    out.unlink(missing_ok=True)
    os.kill(gateway.process.pid, signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            samples: list[int] = json.loads(out.read_text())
            return samples
        except (OSError, ValueError):  # not written yet, or half written
            time.sleep(0.02)
    raise AssertionError("the gateway did not write its turn counts")


def test_a_streams_first_bytes_leave_within_a_few_turns_of_arrival(
    counted: tuple[Gateway, Path], context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    """Streamed: its first bytes follow the worker's first chunk, which the simulator sends with
    its head (a non-streamed answer's wait on the simulator's paced tokens, turns of its own)."""
    gateway, out = counted
    # Every prompt is prefilled on the generation worker: the path without a context phase.
    cluster = register_cluster(context_worker, generation_worker, max_local_prefill_tokens=1_000_000)
    wait_registered(gateway, cluster)
    body = {"model": cluster.model, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi [sim tokens=4]"}]}
    with httpx.Client(base_url=gateway.url, headers=cluster.headers(), timeout=10.0, trust_env=False) as client:
        for _ in range(5):  # warm: the worker connection, the key's cache
            assert client.post("/v1/messages", json=body).status_code == 200
        take_samples(gateway, out)
        for _ in range(20):
            assert client.post("/v1/messages", json=body).status_code == 200
        samples = take_samples(gateway, out)
    assert len(samples) == 20, samples
    assert min(samples) <= FEWEST_TURNS, sorted(samples)
