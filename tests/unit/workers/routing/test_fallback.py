"""A role with no usable endpoint: routed despite probes that only time out, else refused with its
reasons in the log once per interval (pure: the process's health state set by hand, no workers)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from workers.cluster import health as health_module
from workers.cluster.health import ProbeState, health
from workers.cluster.metrics import routed_despite_probes
from workers.cluster.registry import EndpointInfo, PoolInfo
from workers.routing import fallback

SLOW = EndpointInfo(id=901, pool_name="p", role="generation", url="http://slow:1", enabled=True, draining=False, healthy=True)
DOWN = EndpointInfo(id=902, pool_name="p", role="generation", url="http://down:2", enabled=True, draining=False, healthy=True)
DRAINING = EndpointInfo(id=903, pool_name="p", role="generation", url="http://drain:3", enabled=True, draining=True, healthy=True)
CONTEXT = EndpointInfo(id=904, pool_name="p", role="context", url="http://ctx:4", enabled=True, draining=False, healthy=True)


def pool(*endpoints: EndpointInfo) -> PoolInfo:
    return PoolInfo(
        id=90, name="p", model="m", schedule_style="context_first", max_local_prefill_tokens=0, routing="round_robin",
        protocol="trtllm", created_at=datetime(2026, 12, 6, tzinfo=timezone.utc), endpoints=endpoints,
    )


def unhealthy(endpoint: EndpointInfo, *, timed_out: bool) -> None:
    state = health.probes[endpoint.id] = ProbeState(last_checked_at=1.0)
    for _ in range(3):
        health_module._failed(state, "no answer within 2 s" if timed_out else "connection refused", timed_out=timed_out)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch, settings: object) -> Iterator[None]:
    settings.HEALTH_UNHEALTHY_AFTER = 3  # type: ignore[attr-defined]
    monkeypatch.setattr(fallback, "_despite", set())
    monkeypatch.setattr(fallback, "_explained_at", {})
    yield
    for endpoint in (SLOW, DOWN, DRAINING, CONTEXT):
        health.probes.pop(endpoint.id, None)
        health.breakers.pop(endpoint.id, None)


def routed(role: str = "generation") -> float:
    return routed_despite_probes.labels("p", role)._value.get()


def test_only_endpoints_whose_probes_time_out_are_routed_despite_them(caplog: pytest.LogCaptureFixture) -> None:
    unhealthy(SLOW, timed_out=True)
    unhealthy(DOWN, timed_out=False)
    before = routed()
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        for _ in range(3):
            assert fallback.despite_probes(pool(SLOW, DOWN, DRAINING, CONTEXT), "generation") == [SLOW]
    assert routed() == before + 3
    # Logged when the role starts needing it, not per request.
    assert len(caplog.records) == 1
    assert "routing to its generation endpoints despite their probes" in caplog.records[0].getMessage()


def test_nothing_despite_probes_for_a_retry_excluding_it_or_a_refused_endpoint() -> None:
    unhealthy(SLOW, timed_out=True)
    unhealthy(DOWN, timed_out=False)
    assert fallback.despite_probes(pool(SLOW, DOWN), "generation", exclude=[SLOW.url]) == []
    assert fallback.despite_probes(pool(DOWN), "generation") == []


def test_review_logs_once_when_the_role_passes_its_probes_again(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    unhealthy(SLOW, timed_out=True)
    current = pool(SLOW)
    monkeypatch.setattr(fallback, "get_registry", lambda: SimpleNamespace(current=lambda: SimpleNamespace(pools=(current,))))
    fallback.despite_probes(current, "generation")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        fallback.review()
        assert not caplog.records  # still failing its probes
        health.probes[SLOW.id].healthy = True
        fallback.review()
        fallback.review()
    assert [r.getMessage() for r in caplog.records] == ["pool p: generation endpoints pass their probes again"]


def test_a_refusal_explains_every_endpoint_once_per_interval_and_names_none_to_the_client(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    unhealthy(DOWN, timed_out=False)
    now = [1000.0]
    monkeypatch.setattr(fallback.time, "monotonic", lambda: now[0])
    the_pool = pool(DOWN, DRAINING, replace(SLOW, enabled=False), replace(SLOW, id=905, url="http://tried:5"))
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        errors = [fallback.nothing_usable(the_pool, "generation", exclude=["http://tried:5"]) for _ in range(3)]
        now[0] += fallback.EXPLAIN_INTERVAL_S
        fallback.nothing_usable(the_pool, "generation")
    for error in errors:
        assert (error.status, error.code, error.stage) == (503, "no_endpoint", "generation")
        assert error.message == "no generation worker is available for model 'm'"
    assert len(caplog.records) == 2
    line = caplog.records[0].getMessage()
    assert line.startswith("no generation endpoint of pool p (model 'm') can take a request: ")
    assert "#902 (http://down:2): unhealthy since " in line and "(3 failed probes, last: connection refused)" in line
    assert "#903 (http://drain:3): draining" in line
    assert "#901 (http://slow:1): disabled" in line
    assert "#905 (http://tried:5): already tried by this request (retry)" in line
    assert "ctx" not in line


def test_a_role_with_no_endpoint_registered_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        fallback.nothing_usable(pool(SLOW), "context")
    assert caplog.records[0].getMessage().endswith("can take a request: the pool has none registered")


def test_slow_only_neither_counts_nor_logs(caplog: pytest.LogCaptureFixture) -> None:
    unhealthy(SLOW, timed_out=True)
    before = routed()
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        assert fallback.slow_only(pool(SLOW, CONTEXT), "generation") == [SLOW]
        assert fallback.slow_only(pool(SLOW, CONTEXT), "generation", exclude=[SLOW.url]) == []
    assert routed() == before and not caplog.records
