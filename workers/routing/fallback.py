"""When a role has no usable endpoint: route despite the probes if only slow probes stand in the
way, else refuse, and say in the log why each endpoint was left out.

A probe that gets no answer in time says the worker is slow *or* down, and cannot tell which: a
worker streaming at full CPU answers /health behind its streams (the soak's sim at 100 % of a
core under load answered it seconds late while it served). With one endpoint per role, three such
probes took the whole role away and live workers' requests were refused 529 "no generation
worker is available". Envoy's answer is its panic threshold: when too few hosts pass their health
checks, route to all of them, since refusing everything is worse than trying. Here the rule is
narrower: only when nothing of the role is usable, and only among endpoints enabled, undrained,
allowed by their breaker, and failing nothing but timeouts since their last good probe (a refused
connection or an error answer is a verdict: nothing listens, or the worker says it is broken).
The breaker, fed by real requests' outcomes, still takes away a worker that is truly gone.

Nothing here runs while a role has a usable endpoint: `router._usable` calls it only when
`candidates` found none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from workers.cluster.health import health
from workers.cluster.metrics import routed_despite_probes
from workers.cluster.registry import EndpointInfo, PoolInfo, get_registry
from workers.exceptions import NoEndpointAvailable

__all__ = ["despite_probes", "EXPLAIN_INTERVAL_S", "nothing_usable", "review", "slow_only", "why_left_out"]

logger = logging.getLogger(__name__)

#: The reasons of a refused role are logged at most once per this many seconds per role.
EXPLAIN_INTERVAL_S = 30.0

# (pool name, role) routed despite their probes since the last review, and when each role's
# refusal was last explained.
_despite: set[tuple[str, str]] = set()
_explained_at: dict[tuple[str, str], float] = {}


def despite_probes(pool: PoolInfo, role: str, exclude: Iterable[str] = ()) -> list[EndpointInfo]:
    """The endpoints of `role` to route to although their probes fail (see the module's rule);
    empty when there are none. Counted per request, logged when the role starts needing it."""
    excluded = tuple(exclude)
    chosen = slow_only(pool, role, excluded)
    if chosen:
        routed_despite_probes.labels(pool.name, role).inc()
        key = (pool.name, role)
        if key not in _despite:
            _despite.add(key)
            logger.warning(
                "pool %s: no %s endpoint passes its probes; routing to its %s endpoints despite their probes, which get no "
                "answer in time (slow, not refusing): %s",
                pool.name, role, role, _reasons(pool, role, set(excluded)),
            )
    return chosen


def slow_only(pool: PoolInfo, role: str, exclude: Iterable[str] = ()) -> list[EndpointInfo]:
    """The endpoints of `role` but `exclude` (URLs) left out only because their probes get no
    answer in time (`EndpointHealth.slow_not_down`); not counted, not logged."""
    excluded = set(exclude)
    return [e for e in pool.endpoints if e.role == role and e.url not in excluded and health.slow_not_down(e)]


def review() -> None:
    """After a round of probes: log, once, each role routed despite its probes that has an
    endpoint passing them again."""
    if not _despite:
        return
    snapshot = get_registry().current()
    pools = {pool.name: pool for pool in snapshot.pools} if snapshot is not None else {}
    for name, role in sorted(_despite):
        pool = pools.get(name)
        if pool is None or any(e.role == role and health.usable(e) for e in pool.endpoints):
            _despite.discard((name, role))
            logger.warning("pool %s: %s endpoints pass their probes again", name, role)


def nothing_usable(pool: PoolInfo, role: str, exclude: Iterable[str] = ()) -> NoEndpointAvailable:
    """The refusal for a role with nothing to route to. Why each endpoint was left out goes to the
    log (with addresses: it is the operator's), at most once per `EXPLAIN_INTERVAL_S` per role;
    the client's message names no endpoint."""
    key = (pool.name, role)
    now = time.monotonic()
    last = _explained_at.get(key)
    if last is None or now - last >= EXPLAIN_INTERVAL_S:
        _explained_at[key] = now
        logger.warning(
            "no %s endpoint of pool %s (model %r) can take a request: %s", role, pool.name, pool.model, _reasons(pool, role, set(exclude))
        )
    return NoEndpointAvailable(
        503, f"no {role} worker is available for model {pool.model!r}", stage=role, code="no_endpoint", retry_after=1.0
    )


def why_left_out(endpoint: EndpointInfo, excluded: set[str]) -> str:
    """Why routing leaves the endpoint out of this request ("" when it does not)."""
    reason = health.why_unusable(endpoint)
    if not reason and endpoint.url in excluded:
        return "already tried by this request (retry)"
    return reason


def _reasons(pool: PoolInfo, role: str, excluded: set[str]) -> str:
    endpoints = pool.endpoints_for(role)
    if not endpoints:
        return "the pool has none registered"
    return "; ".join(f"#{e.id} ({e.url}): {why_left_out(e, excluded) or 'usable'}" for e in endpoints)
