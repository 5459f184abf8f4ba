"""The circuit breaker's state machine (pure: a fake clock, no workers)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from workers import health as health_module
from workers.health import BreakerState, EndpointHealth
from workers.registry import EndpointInfo

ENDPOINT = EndpointInfo(id=7, pool_name="p", role="generation", url="http://w", enabled=True, draining=False, healthy=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch, settings: object) -> Clock:
    clock = Clock()
    monkeypatch.setattr(health_module.time, "monotonic", clock)
    settings.BREAKER_FAILURE_THRESHOLD = 3  # type: ignore[attr-defined]
    settings.BREAKER_COOLDOWN_S = 30  # type: ignore[attr-defined]
    return clock


def test_opens_after_consecutive_failures_and_half_opens_for_one_trial(clock: Clock) -> None:
    health = EndpointHealth()
    for _ in range(2):
        health.record_failure(ENDPOINT.id)
    assert health.usable(ENDPOINT)
    health.record_failure(ENDPOINT.id)
    assert health.breaker_state(ENDPOINT.id) == BreakerState.OPEN and not health.usable(ENDPOINT)

    clock.now += 30
    assert health.breaker_state(ENDPOINT.id) == BreakerState.HALF_OPEN and health.usable(ENDPOINT)
    health.on_routed(ENDPOINT.id)
    assert not health.usable(ENDPOINT)  # only one trial at a time
    health.record_success(ENDPOINT.id)
    assert health.breaker_state(ENDPOINT.id) == BreakerState.CLOSED and health.usable(ENDPOINT)


def test_a_failed_trial_reopens(clock: Clock) -> None:
    health = EndpointHealth()
    for _ in range(3):
        health.record_failure(ENDPOINT.id)
    clock.now += 30
    health.on_routed(ENDPOINT.id)
    health.record_failure(ENDPOINT.id)
    assert health.breaker_state(ENDPOINT.id) == BreakerState.OPEN
    clock.now += 29
    assert not health.usable(ENDPOINT)


def test_a_trial_whose_outcome_never_comes_does_not_block_for_ever(clock: Clock) -> None:
    health = EndpointHealth()
    for _ in range(3):
        health.record_failure(ENDPOINT.id)
    clock.now += 30
    health.on_routed(ENDPOINT.id)  # its client leaves: no success, no failure is recorded
    clock.now += 10
    assert not health.usable(ENDPOINT)
    clock.now += 20
    assert health.usable(ENDPOINT)


def test_success_resets_the_count(clock: Clock) -> None:
    health = EndpointHealth()
    health.record_failure(ENDPOINT.id)
    health.record_failure(ENDPOINT.id)
    health.record_success(ENDPOINT.id)
    health.record_failure(ENDPOINT.id)
    health.record_failure(ENDPOINT.id)
    assert health.usable(ENDPOINT)


def test_disabled_draining_and_unhealthy_are_not_usable(clock: Clock) -> None:
    health = EndpointHealth()
    assert health.usable(ENDPOINT)
    for changes in ({"enabled": False}, {"draining": True}, {"healthy": False}):
        assert not health.usable(replace(ENDPOINT, **changes)), changes
