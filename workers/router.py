"""Picks an endpoint for a stage of a request, by the pool's routing policy, and reserves it.

Routing reads only memory: the registry snapshot and this process's open reservations (plus, for
`least_loaded`, the other processes' open reservations as of the last registry refresh).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

from workers.errors import NoEndpointAvailable
from workers.health import health
from workers.models import RoutingPolicy
from workers.registry import EndpointInfo, PoolInfo
from workers.reservations import Reservation, ledger

Policy = Callable[[PoolInfo, str, list[EndpointInfo], str | None], EndpointInfo]

# Per (pool, role): the URL picked last. Rotating over the role's full endpoint list (rather than
# counting over whatever is usable right now) keeps the rotation fair when retries exclude an
# endpoint or endpoints come and go.
_last_picked: dict[tuple[str, str], str] = {}


def _round_robin(pool: PoolInfo, role: str, candidates: list[EndpointInfo], session: str | None) -> EndpointInfo:
    key = (pool.name, role)
    order = [e.url for e in pool.endpoints if e.role == role]
    last = _last_picked.get(key)
    start = order.index(last) + 1 if last in order else 0
    usable = {e.url: e for e in candidates}
    for offset in range(len(order)):
        url = order[(start + offset) % len(order)]
        if url in usable:
            _last_picked[key] = url
            return usable[url]
    _last_picked[key] = candidates[0].url
    return candidates[0]


def _load(endpoint: EndpointInfo) -> int:
    return ledger.open_count(endpoint.id) + endpoint.remote_open


def _least_loaded(pool: PoolInfo, role: str, candidates: list[EndpointInfo], session: str | None) -> EndpointInfo:
    # Ties go round robin so that an idle pool still spreads its work.
    lowest = min(_load(e) for e in candidates)
    tied = [e for e in candidates if _load(e) == lowest]
    return _round_robin(pool, role, tied, session)


def _session_affinity(pool: PoolInfo, role: str, candidates: list[EndpointInfo], session: str | None) -> EndpointInfo:
    if not session:
        return _least_loaded(pool, role, candidates, session)
    # Rendezvous hashing: a session stays on its endpoint while that endpoint is routable, and
    # only the sessions of an endpoint that leaves move.
    return max(candidates, key=lambda e: hashlib.blake2b(f"{session}|{e.url}".encode(), digest_size=8).digest())


POLICIES: dict[str, Policy] = {
    RoutingPolicy.ROUND_ROBIN: _round_robin,
    RoutingPolicy.LEAST_LOADED: _least_loaded,
    RoutingPolicy.SESSION_AFFINITY: _session_affinity,
}


def candidates(pool: PoolInfo, role: str, exclude: Iterable[str] = ()) -> list[EndpointInfo]:
    """Endpoints of `role` that may take a new request now (enabled, not draining, healthy,
    breaker closed), minus `exclude` (URLs already tried for this request)."""
    excluded = set(exclude)
    return [e for e in pool.endpoints if e.role == role and e.url not in excluded and health.usable(e)]


def reserve(
    pool: PoolInfo,
    role: str,
    request_id: str,
    *,
    session: str | None = None,
    exclude: Iterable[str] = (),
) -> Reservation:
    """Reserve a routable endpoint of `role` in `pool`, or raise NoEndpointAvailable."""
    usable = candidates(pool, role, exclude)
    if not usable:
        raise NoEndpointAvailable(
            503,
            f"no {role} worker is available for model {pool.model!r}",
            stage=role,
            code="no_endpoint",
            retry_after=1.0,
        )
    if exclude:
        # A retry: the least loaded of the others, leaving the policy's rotation untouched so
        # that a failing endpoint does not shift every later request's turn.
        endpoint = min(usable, key=_load)
    else:
        policy = POLICIES.get(pool.routing, _round_robin)
        # Affinity matters for generation (its prefix cache); the context phase is stateless.
        endpoint = policy(pool, role, usable, session if role == "generation" else None)
    health.on_routed(endpoint.id)
    return Reservation.take(request_id, endpoint, role)
