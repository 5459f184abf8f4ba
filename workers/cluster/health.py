"""Endpoint health as this process sees it: the `/health` prober and a circuit breaker per
endpoint fed by real request outcomes.

Routing asks `usable(endpoint)`. The prober's verdict is written to the database when it changes,
so the admin shows it and processes that have not probed yet route by it; each process's own
probes and breakers take precedence for its own routing.

A probe's timeout counts only the time this process's loop ran (`probe_deadline`): a gateway
late past the deadline reads the answer that arrived meanwhile rather than blaming the worker. A
probe that still gets no answer in time says "slow or down", not which: `slow_not_down` tells
routing which unhealthy endpoints failed only so (`workers.routing.fallback` routes to them when
their role has nothing else), and `why_unusable` says in words why an endpoint is left out.

Request outcomes reach the breakers through one call, `report(endpoint_id, error, tenant=...)`,
which decides from what the failure says:

- the endpoint failed (connection refused or cut, a bare 502/503 from whatever is in front of
  the worker, a timeout, overload: 429/503/529): it counts for the endpoint, whoever sent it;
- the worker answered this request with an error (a 500, or another 5xx with a body): that may
  follow the request's own content, so it counts only once `BREAKER_DISTINCT_KEYS` different API
  keys have seen such failures from the endpoint within `BREAKER_KEY_WINDOW_S`. One key sending
  a prompt that makes the worker fail cannot take the endpoint away from everyone else;
- anything else (4xx) says nothing about the endpoint.

A breaker counts only failures of requests sent to its own endpoint: a generation failure never
counts against the context endpoint that served the same request (SGLang's PD router records a
decode 5xx against both, so a broken decode worker also shuts its healthy prefill workers out).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum

from django.conf import settings

from disagg_project import DatabaseThread
from workers.cluster.probe_deadline import LagTolerantDeadline
from workers.cluster.registry import EndpointInfo, get_registry
from workers.exceptions import StreamBroken, WorkerError, WorkerUnreachable
from workers.wire import client

logger = logging.getLogger(__name__)

# The probe's own call gives up this many times its timeout (the lag-tolerant deadline decides
# before, unless the loop lags for that long).
_BACKSTOP = 10


@dataclass(slots=True)
class ProbeState:
    healthy: bool = True
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_error: str = ""
    last_checked_at: float = 0.0
    last_written_at: float = 0.0
    #: When this process marked the endpoint unhealthy (wall clock, for the log; None: healthy).
    unhealthy_since: float | None = None
    #: Every failure since the last success was a probe that got no answer in time: the worker
    #: may be slow rather than down (a refused connection or an error answer is a verdict).
    only_timeouts: bool = False


class FailureScope(Enum):
    ENDPOINT = "endpoint"  # the endpoint (or the way to it) is failing, for every request
    REQUEST = "request"  # the worker failed this request; it may follow the request's content


# Statuses that mean "too busy now". They may follow one key's own flood (the engine's queue is
# full of that key's requests), so, like other worker errors, they count against the endpoint
# only once several keys see them: one key's traffic cannot open the breaker for everyone.
OVERLOAD_STATUSES = frozenset({429, 503, 529})


def failure_scope(error: WorkerError) -> FailureScope | None:
    """What a failed worker call says about its endpoint; None when it says nothing (a 4xx: the
    request itself was refused)."""
    if isinstance(error, (WorkerUnreachable, StreamBroken)):
        # Refused, reset or cut connections, and bare 502/503 answers (WorkerUnreachable).
        return FailureScope.ENDPOINT
    if error.code == "timeout" or error.status == 504:
        return FailureScope.ENDPOINT
    if error.status >= 500 or error.status in OVERLOAD_STATUSES:
        return FailureScope.REQUEST
    return None


class BreakerState:
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class Breaker:
    failures: int = 0
    opened_at: float | None = None
    # When the half-open breaker let its one trial request through (None: no trial out). A trial
    # whose outcome never comes (its client left) does not block the endpoint for ever: after
    # another cool-down a new trial goes.
    trial_started_at: float | None = None
    # Request-scoped failures not (yet) counted: when each API key last saw one.
    failing_keys: dict[str, float] = field(default_factory=dict)

    def state(self, now: float, cooldown: float) -> str:
        if self.opened_at is None:
            return BreakerState.CLOSED
        return BreakerState.HALF_OPEN if now - self.opened_at >= cooldown else BreakerState.OPEN


class EndpointHealth:
    def __init__(self) -> None:
        self.probes: dict[int, ProbeState] = {}
        self.breakers: dict[int, Breaker] = {}

    # --- routing -----------------------------------------------------------------------------------

    def usable(self, endpoint: EndpointInfo) -> bool:
        if not (endpoint.enabled and not endpoint.draining):
            return False
        probe = self.probes.get(endpoint.id)
        healthy = probe.healthy if probe is not None and probe.last_checked_at else endpoint.healthy
        return healthy and self._breaker_allows(endpoint.id)

    def slow_not_down(self, endpoint: EndpointInfo) -> bool:
        """Whether the endpoint is left out only because this process's probes of it got no
        answer in time: enabled, not draining, breaker allowing, and no refused connection or
        error answer since its last good probe (`workers.routing.fallback` may route to it when
        its role has nothing else)."""
        if not (endpoint.enabled and not endpoint.draining):
            return False
        probe = self.probes.get(endpoint.id)
        return probe is not None and not probe.healthy and probe.only_timeouts and self._breaker_allows(endpoint.id)

    def why_unusable(self, endpoint: EndpointInfo) -> str:
        """Why routing leaves the endpoint out, for the operator's log ("" when it does not)."""
        if not endpoint.enabled:
            return "disabled"
        if endpoint.draining:
            return "draining"
        probe = self.probes.get(endpoint.id)
        if probe is not None and probe.last_checked_at:
            if not probe.healthy:
                since = "" if probe.unhealthy_since is None else f" since {_clock(probe.unhealthy_since)}"
                failures = probe.consecutive_failures
                return (
                    f"unhealthy{since} ({failures} failed probe{'s' if failures != 1 else ''}, last: {probe.last_error or 'none'})"
                )
        elif not endpoint.healthy:
            return "unhealthy by another gateway process's probes (none here yet)"
        state = self.breaker_state(endpoint.id)
        if state == BreakerState.OPEN:
            return f"circuit breaker open after {self.breakers[endpoint.id].failures} failures"
        if state == BreakerState.HALF_OPEN and not self._breaker_allows(endpoint.id):
            return "circuit breaker half-open, its one trial request under way"
        return ""

    def _breaker_allows(self, endpoint_id: int) -> bool:
        breaker = self.breakers.get(endpoint_id)
        if breaker is None:
            return True
        state = breaker.state(time.monotonic(), settings.BREAKER_COOLDOWN_S)
        if state == BreakerState.CLOSED:
            return True
        if state == BreakerState.HALF_OPEN:
            started = breaker.trial_started_at
            return started is None or time.monotonic() - started >= settings.BREAKER_COOLDOWN_S
        return False

    def on_routed(self, endpoint_id: int) -> None:
        """A request was just routed to the endpoint: a half-open breaker lets only this one by."""
        breaker = self.breakers.get(endpoint_id)
        now = time.monotonic()
        if breaker is not None and breaker.state(now, settings.BREAKER_COOLDOWN_S) == BreakerState.HALF_OPEN:
            breaker.trial_started_at = now

    # --- request outcomes --------------------------------------------------------------------------

    def report(self, endpoint_id: int, error: WorkerError | None, *, tenant: str | None = None) -> None:
        """A worker call's outcome (`error` None: success), from the API key `tenant`."""
        if error is None:
            self.record_success(endpoint_id)
            return
        scope = failure_scope(error)
        if scope is FailureScope.ENDPOINT:
            self.record_failure(endpoint_id)
        elif scope is FailureScope.REQUEST:
            self.record_request_failure(endpoint_id, tenant)

    def record_request_failure(self, endpoint_id: int, tenant: str | None) -> None:
        """A failure that may follow the request's content: it counts like any other once
        `BREAKER_DISTINCT_KEYS` keys (requests without a key share one) saw such failures from
        the endpoint within `BREAKER_KEY_WINDOW_S`."""
        now = time.monotonic()
        breaker = self.breakers.setdefault(endpoint_id, Breaker())
        keys = breaker.failing_keys
        window = settings.BREAKER_KEY_WINDOW_S
        for key in [k for k, at in keys.items() if now - at > window]:
            del keys[key]
        keys[tenant or ""] = now
        if len(keys) >= settings.BREAKER_DISTINCT_KEYS:
            self.record_failure(endpoint_id)
        else:
            # No verdict on the endpoint: a half-open breaker's trial slot goes to the next request.
            breaker.trial_started_at = None

    def record_success(self, endpoint_id: int) -> None:
        breaker = self.breakers.get(endpoint_id)
        if breaker is not None:
            del self.breakers[endpoint_id]

    def record_failure(self, endpoint_id: int) -> None:
        breaker = self.breakers.setdefault(endpoint_id, Breaker())
        breaker.failures += 1
        breaker.trial_started_at = None
        if breaker.opened_at is not None or breaker.failures >= settings.BREAKER_FAILURE_THRESHOLD:
            if breaker.opened_at is None:
                logger.warning("circuit breaker opened for endpoint #%s after %d failures", endpoint_id, breaker.failures)
            breaker.opened_at = time.monotonic()

    def breaker_state(self, endpoint_id: int) -> str:
        breaker = self.breakers.get(endpoint_id)
        return BreakerState.CLOSED if breaker is None else breaker.state(time.monotonic(), settings.BREAKER_COOLDOWN_S)

    # --- the prober ----------------------------------------------------------------------------------

    async def probe_all(self) -> None:
        snapshot = await get_registry().snapshot()
        endpoints = [e for pool in snapshot.pools for e in pool.endpoints if e.enabled]
        if endpoints:
            await asyncio.gather(*(self.probe(e) for e in endpoints))

    async def probe(self, endpoint: EndpointInfo) -> None:
        # The first probe here starts from the verdict in the database, another process's (or a
        # former one's): a good first answer here overrules an unhealthy one at once (else a
        # process started after another marked a worker down would refuse its requests for
        # HEALTH_HEALTHY_AFTER intervals although its own probe found the worker up).
        first = endpoint.id not in self.probes
        state = self.probes.setdefault(endpoint.id, ProbeState(healthy=endpoint.healthy))
        was_healthy = state.healthy
        timeout = settings.HEALTH_CHECK_TIMEOUT_S
        try:
            # The deadline that counts is the lag-tolerant one; the call's own is a backstop.
            async with LagTolerantDeadline(timeout):
                await client.get_json(endpoint.url + "/health", timeout=timeout * _BACKSTOP)
        except TimeoutError:
            _failed(state, f"no answer within {timeout:g} s", timed_out=True)
        except WorkerError as exc:
            _failed(state, exc.message, timed_out=exc.code == "timeout")
        except Exception as exc:  # a malformed /health answer is a failed check, not a crash
            _failed(state, f"malformed health answer: {type(exc).__name__}", timed_out=False)
        else:
            state.consecutive_successes += 1
            state.consecutive_failures = 0
            state.only_timeouts = False
            if not state.healthy and (first or state.consecutive_successes >= settings.HEALTH_HEALTHY_AFTER):
                state.healthy = True
                state.last_error = ""
                state.unhealthy_since = None
        now = time.monotonic()
        state.last_checked_at = now
        changed = state.healthy != was_healthy or state.healthy != endpoint.healthy
        if changed:
            logger.warning("endpoint %s is now %s", endpoint.url, "healthy" if state.healthy else "unhealthy")
        if changed or now - state.last_written_at >= settings.HEALTH_WRITE_INTERVAL_S:
            state.last_written_at = now
            await _PROBE_WRITES.run(_write_probe, endpoint.id, state)


def _failed(state: ProbeState, error: str, *, timed_out: bool) -> None:
    state.only_timeouts = timed_out and (state.only_timeouts or state.consecutive_failures == 0)
    state.consecutive_failures += 1
    state.consecutive_successes = 0
    state.last_error = error
    if state.consecutive_failures >= settings.HEALTH_UNHEALTHY_AFTER:
        state.healthy = False
    if not state.healthy and state.unhealthy_since is None:
        state.unhealthy_since = time.time()


def _clock(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%H:%M:%S")


def _write_probe(endpoint_id: int, state: ProbeState) -> None:
    from workers.models import WorkerEndpoint

    # update(): the admin's edits to other fields are never overwritten by a stale copy.
    WorkerEndpoint.objects.filter(pk=endpoint_id).update(
        healthy=state.healthy,
        consecutive_failures=state.consecutive_failures,
        last_error=state.last_error[:1000],
        last_checked_at=datetime.now(timezone.utc),
    )


# The probes' writes' own thread (see workers.cluster.db_thread).
_PROBE_WRITES = DatabaseThread("health-db")


health = EndpointHealth()
