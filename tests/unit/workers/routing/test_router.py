"""Spill-over across a model's pools when none passes its probes (pure: health state set by hand)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone

import pytest

from workers.cluster import health as health_module
from workers.cluster.health import ProbeState, health
from workers.cluster.registry import EndpointInfo, PoolInfo, Served
from workers.routing.router import choose_pool


def pool(pool_id: int, *, enabled: bool = True) -> PoolInfo:
    endpoint = EndpointInfo(
        id=9300 + pool_id, pool_name=f"p{pool_id}", role="generation", url=f"http://g{pool_id}", enabled=enabled, draining=False,
        healthy=True,
    )
    return PoolInfo(
        id=pool_id, name=f"p{pool_id}", model="m", schedule_style="aggregated", max_local_prefill_tokens=0, routing="round_robin",
        protocol="trtllm", created_at=datetime(2026, 12, 6, tzinfo=timezone.utc), endpoints=(endpoint,),
    )


def slow(the_pool: PoolInfo) -> None:
    state = health.probes[the_pool.endpoints[0].id] = ProbeState(last_checked_at=1.0)
    for _ in range(3):
        health_module._failed(state, "no answer within 2 s", timed_out=True)


@pytest.fixture(autouse=True)
def forget_health(settings: object) -> Iterator[None]:
    settings.HEALTH_UNHEALTHY_AFTER = 3  # type: ignore[attr-defined]
    yield
    for pool_id in range(1, 4):
        health.probes.pop(9300 + pool_id, None)


async def test_with_no_pool_passing_its_probes_the_first_only_slow_one_is_chosen() -> None:
    disabled, slow_one, other_slow = pool(1, enabled=False), pool(2), pool(3)
    slow(slow_one)
    slow(other_slow)
    served = [Served(p, "m") for p in (disabled, slow_one, other_slow)]
    assert choose_pool(served).pool is slow_one


async def test_a_pool_passing_its_probes_comes_before_a_slow_one() -> None:
    slow_one, healthy = pool(1), pool(2)
    slow(slow_one)
    assert choose_pool([Served(slow_one, "m"), Served(healthy, "m")]).pool is healthy


async def test_with_nothing_routable_the_first_pool_answers() -> None:
    first, second = pool(1, enabled=False), pool(2, enabled=False)
    assert choose_pool([Served(first, "m"), Served(second, "m")]).pool is first
