"""The circuit breaker's state machine and what counts toward it (pure: a fake clock, no workers)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from workers.cluster import health as health_module
from workers.cluster.health import BreakerState, EndpointHealth, FailureScope, ProbeState, failure_scope
from workers.cluster.registry import EndpointInfo
from workers.exceptions import StreamBroken, WorkerError, WorkerUnreachable

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
    settings.BREAKER_DISTINCT_KEYS = 2  # type: ignore[attr-defined]
    settings.BREAKER_KEY_WINDOW_S = 60  # type: ignore[attr-defined]
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


# --- what a failure says about its endpoint ----------------------------------------------------------

WORKER_500 = WorkerError(500, "Internal Server Error (simulated)", stage="generation")


@pytest.mark.parametrize(
    "error,scope",
    [
        (WorkerUnreachable(503, "could not be reached", stage="context", code="unreachable"), FailureScope.ENDPOINT),
        (WorkerUnreachable(502, "answered 502 without a body", stage="generation", code="no_answer"), FailureScope.ENDPOINT),
        (StreamBroken(502, "closed the stream before it was complete", stage="generation"), FailureScope.ENDPOINT),
        (WorkerError(504, "timed out", stage="context", code="timeout"), FailureScope.ENDPOINT),
        (WorkerError(429, "slow down", stage="generation"), FailureScope.REQUEST),
        (WorkerError(503, "overloaded", stage="generation"), FailureScope.REQUEST),
        (WorkerError(529, "overloaded", stage="generation"), FailureScope.REQUEST),
        (WORKER_500, FailureScope.REQUEST),
        (WorkerError(502, "the generation worker returned a malformed answer", stage="generation"), FailureScope.REQUEST),
        (WorkerError(400, "bad request", stage="context"), None),
        (WorkerError(404, "no such model", stage="context"), None),
    ],
)
def test_failure_scope(error: WorkerError, scope: FailureScope | None) -> None:
    assert failure_scope(error) is scope


def test_one_key_alone_never_opens_the_breaker_with_worker_500s(clock: Clock) -> None:
    health = EndpointHealth()
    for _ in range(50):
        health.report(ENDPOINT.id, WORKER_500, tenant="alice")
        clock.now += 0.1
    assert health.breaker_state(ENDPOINT.id) == BreakerState.CLOSED and health.usable(ENDPOINT)


def test_worker_500s_from_distinct_keys_open_it(clock: Clock) -> None:
    health = EndpointHealth()
    health.report(ENDPOINT.id, WORKER_500, tenant="alice")
    health.report(ENDPOINT.id, WORKER_500, tenant="alice")  # alone: not counted
    health.report(ENDPOINT.id, WORKER_500, tenant="bob")  # two keys: counted from here on
    health.report(ENDPOINT.id, WORKER_500, tenant="alice")
    assert health.usable(ENDPOINT)
    health.report(ENDPOINT.id, WORKER_500, tenant="bob")
    assert health.breaker_state(ENDPOINT.id) == BreakerState.OPEN


def test_keys_count_only_within_the_window(clock: Clock) -> None:
    health = EndpointHealth()
    health.report(ENDPOINT.id, WORKER_500, tenant="alice")
    clock.now += 61  # alice's failure has left the window
    for _ in range(5):
        health.report(ENDPOINT.id, WORKER_500, tenant="bob")
    assert health.breaker_state(ENDPOINT.id) == BreakerState.CLOSED


def test_requests_without_a_key_count_as_one_key(clock: Clock) -> None:
    health = EndpointHealth()
    for _ in range(5):
        health.report(ENDPOINT.id, WORKER_500, tenant=None)
    assert health.breaker_state(ENDPOINT.id) == BreakerState.CLOSED


def test_connection_failures_count_whoever_sent_them(clock: Clock) -> None:
    health = EndpointHealth()
    unreachable = WorkerUnreachable(503, "could not be reached", stage="generation", code="unreachable")
    for _ in range(3):
        health.report(ENDPOINT.id, unreachable, tenant="alice")
    assert health.breaker_state(ENDPOINT.id) == BreakerState.OPEN


def test_one_keys_overload_answers_do_not_open_the_breaker_for_everyone(clock: Clock) -> None:
    """An engine answering 503 to one key's flood says that key filled it, not that it is broken."""
    health = EndpointHealth()
    overload = WorkerError(503, "overloaded", stage="generation")
    for _ in range(10):
        health.report(ENDPOINT.id, overload, tenant="noisy")
    assert health.breaker_state(ENDPOINT.id) == BreakerState.CLOSED
    for _ in range(3):
        health.report(ENDPOINT.id, overload, tenant="quiet")  # now two keys see it: it counts
    assert health.breaker_state(ENDPOINT.id) == BreakerState.OPEN


def test_client_errors_say_nothing_and_success_closes(clock: Clock) -> None:
    health = EndpointHealth()
    for _ in range(5):
        health.report(ENDPOINT.id, WorkerError(400, "bad request", stage="context"), tenant="alice")
    assert health.breaker_state(ENDPOINT.id) == BreakerState.CLOSED
    health.report(ENDPOINT.id, WORKER_500, tenant="alice")
    health.report(ENDPOINT.id, None, tenant="bob")  # a success forgets the keys seen failing
    health.report(ENDPOINT.id, WORKER_500, tenant="bob")
    health.report(ENDPOINT.id, WORKER_500, tenant="bob")
    health.report(ENDPOINT.id, WORKER_500, tenant="bob")
    assert health.breaker_state(ENDPOINT.id) == BreakerState.CLOSED


def test_one_key_setting_restores_counting_every_500(clock: Clock, settings: object) -> None:
    settings.BREAKER_DISTINCT_KEYS = 1  # type: ignore[attr-defined]
    health = EndpointHealth()
    for _ in range(3):
        health.report(ENDPOINT.id, WORKER_500, tenant="alice")
    assert health.breaker_state(ENDPOINT.id) == BreakerState.OPEN


def test_a_half_open_trial_that_meets_one_keys_500_gives_the_trial_to_the_next_request(clock: Clock) -> None:
    health = EndpointHealth()
    for _ in range(3):
        health.record_failure(ENDPOINT.id)
    clock.now += 30
    health.on_routed(ENDPOINT.id)
    assert not health.usable(ENDPOINT)
    health.report(ENDPOINT.id, WORKER_500, tenant="alice")
    assert health.usable(ENDPOINT)  # no verdict on the endpoint: another request may try it
    health.on_routed(ENDPOINT.id)
    health.report(ENDPOINT.id, None, tenant="bob")
    assert health.breaker_state(ENDPOINT.id) == BreakerState.CLOSED


# --- what a failed probe says: slow, or down ----------------------------------------------------------


def probed(health: EndpointHealth, *failures: bool) -> ProbeState:
    """The endpoint's probe state after failed probes (`True`: one that got no answer in time)."""
    state = health.probes.setdefault(ENDPOINT.id, ProbeState())
    state.last_checked_at = 1.0
    for timed_out in failures:
        health_module._failed(state, "no answer within 2 s" if timed_out else "connection refused", timed_out=timed_out)
    return state


@pytest.fixture
def unhealthy_after_two(clock: Clock, settings: object) -> None:
    settings.HEALTH_UNHEALTHY_AFTER = 2  # type: ignore[attr-defined]


@pytest.mark.usefixtures("unhealthy_after_two")
def test_an_endpoint_whose_probes_only_time_out_is_slow_not_down() -> None:
    health = EndpointHealth()
    state = probed(health, True)
    assert state.healthy and health.usable(ENDPOINT) and not health.slow_not_down(ENDPOINT)
    probed(health, True)
    assert not health.usable(ENDPOINT) and health.slow_not_down(ENDPOINT)
    assert state.unhealthy_since is not None
    # Disabled, draining or its breaker open: left out whatever its probes say.
    assert not health.slow_not_down(replace(ENDPOINT, draining=True))
    assert not health.slow_not_down(replace(ENDPOINT, enabled=False))
    for _ in range(3):
        health.record_failure(ENDPOINT.id)
    assert not health.slow_not_down(ENDPOINT)


@pytest.mark.usefixtures("unhealthy_after_two")
@pytest.mark.parametrize("failures", [(False, False), (True, False), (False, True)])
def test_one_refused_probe_since_the_last_good_one_makes_it_down(failures: tuple[bool, ...]) -> None:
    health = EndpointHealth()
    probed(health, *failures)
    assert not health.usable(ENDPOINT) and not health.slow_not_down(ENDPOINT)


def test_an_endpoint_marked_unhealthy_elsewhere_and_never_probed_here_is_not_slow(clock: Clock) -> None:
    health = EndpointHealth()
    assert not health.slow_not_down(replace(ENDPOINT, healthy=False))


@pytest.mark.usefixtures("unhealthy_after_two")
def test_why_unusable_names_each_reason() -> None:
    health = EndpointHealth()
    assert health.why_unusable(ENDPOINT) == ""
    assert health.why_unusable(replace(ENDPOINT, enabled=False)) == "disabled"
    assert health.why_unusable(replace(ENDPOINT, draining=True)) == "draining"
    assert health.why_unusable(replace(ENDPOINT, healthy=False)) == "unhealthy by another gateway process's probes (none here yet)"
    probed(health, True, False)
    reason = health.why_unusable(ENDPOINT)
    assert reason.startswith("unhealthy since ") and reason.endswith("(2 failed probes, last: connection refused)"), reason
    health.probes.clear()
    for _ in range(3):
        health.record_failure(ENDPOINT.id)
    assert health.why_unusable(ENDPOINT) == "circuit breaker open after 3 failures"
