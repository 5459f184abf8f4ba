"""Picks an endpoint for a stage of a request, by the pool's routing policy, and reserves it.

Routing reads only memory: the registry snapshot and this process's open reservations (plus, for
`least_loaded`, the other processes' open reservations as of the last registry refresh, and the
engines' own load while fresh: `_load`), and for `cache_aware` this process's prefix index
(`workers.routing.prefix_index`) and, for endpoints whose engines' KV-cache events are followed
and trusted, what those say they hold of a conversation's known prefix (`_held_by_events`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from django.conf import settings

from workers.admission import Ticket, admit
from workers.admission.capacity import fits_here
from workers.admission.queue import get_queue
from workers.cluster.engine_load import engine_loads
from workers.cluster.health import health
from workers.cluster.registry import EndpointInfo, PoolInfo, Served, get_registry
from workers.kv_events.subscriber import kv_events
from workers.models import Role, RoutingPolicy
from workers.routing import fallback
from workers.routing.prefix_index import Prompt, PromptKey, get_index
from workers.routing.reservations import Reservation, ledger
from workers.schedule.rendered_chat import RenderedChat

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
    """How busy the endpoint is, in requests: the one load signal of `least_loaded`, the
    cache-aware choice between two endpoints and its guard, and retries.

    The gateway's own count (this process's open requests plus the other processes' at the last
    refresh) is exact for what went through the gateway. The engine's own figures, while fresh
    (`workers.cluster.engine_load`), also count what did not (other gateways, outside traffic):
    the larger of the two counts, plus a penalty for a nearly full KV cache. Stale or absent
    figures leave the gateway's own count."""
    own = ledger.open_count(endpoint.id) + endpoint.remote_open
    if engine_loads.view:  # empty while polling is off: nothing more to look up
        reported = engine_loads.fresh(endpoint.id)
        if reported is not None:
            # The engine's waiting and running include what the gateway sent it: the larger of
            # the two counts, not their sum; plus what a nearly full KV cache counts as
            # (`engine_load.kv_penalty`, worked out when the figures were read).
            return max(own, reported.requests) + reported.kv_penalty
    return own


def _queued(endpoint: EndpointInfo) -> int:
    """Requests waiting in the engine's own queue, as it last reported while fresh (0 without
    figures): an engine that queues is saturated, whoever sent the work (other gateways, outside
    traffic), and a conversation placed there waits on each of its turns."""
    if engine_loads.view:  # empty while polling is off
        reported = engine_loads.fresh(endpoint.id)
        if reported is not None:
            return reported.load.waiting
    return 0


def _least_loaded(pool: PoolInfo, role: str, candidates: list[EndpointInfo], session: str | None) -> EndpointInfo:
    # Ties go round robin so that an idle pool still spreads its work. Each load is read once.
    loads = [_load(e) for e in candidates]
    lowest = min(loads)
    tied = [e for e, load in zip(candidates, loads, strict=True) if load == lowest]
    return _round_robin(pool, role, tied, session)


def _rendezvous_ranked(key: bytes, candidates: list[EndpointInfo]) -> list[EndpointInfo]:
    # Rendezvous hashing: a key stays on its endpoint while that endpoint is routable, only the
    # keys of an endpoint that leaves move, and every gateway process makes the same choice.
    return sorted(candidates, key=lambda e: hashlib.blake2b(key + b"|" + e.url.encode(), digest_size=8).digest(), reverse=True)


def _rendezvous(key: bytes, candidates: list[EndpointInfo]) -> EndpointInfo:
    return _rendezvous_ranked(key, candidates)[0]


def _session_affinity(pool: PoolInfo, role: str, candidates: list[EndpointInfo], session: str | None) -> EndpointInfo:
    if not session:
        return _least_loaded(pool, role, candidates, session)
    return _rendezvous(session.encode(), candidates)


POLICIES: dict[str, Policy] = {
    RoutingPolicy.ROUND_ROBIN: _round_robin,
    RoutingPolicy.LEAST_LOADED: _least_loaded,
    RoutingPolicy.SESSION_AFFINITY: _session_affinity,
    # Generation goes through `place_generation`, the context phase by cache when given the
    # placement (`reserve(..., placement=)`); without it, the least loaded.
    RoutingPolicy.CACHE_AWARE: _least_loaded,
}


@dataclass(frozen=True, slots=True)
class Placement:
    """A reserved generation endpoint and how much of the prompt it is expected to hold."""

    reservation: Reservation
    #: Bytes of the rendered prompt the endpoint is known to hold (`PrefixIndex.held`), of
    #: `prompt_bytes` (0 of 0 when the pool does not route by prefix).
    matched_bytes: int = 0
    prompt_bytes: int = 0
    #: The prompt as the index sees it: where the context phase goes, should it run (context
    #: workers cache prefixes too). Digests and offsets only, not the prompt's text.
    prompt: Prompt | None = None

    @property
    def key(self) -> PromptKey | None:
        return self.prompt.key if self.prompt is not None else None

    def match_length(self, prompt_tokens: int) -> int:
        """The match in tokens, scaled from bytes to the prompt's (estimated) token count."""
        if not self.prompt_bytes:
            return 0
        return prompt_tokens * self.matched_bytes // self.prompt_bytes


async def place_generation(
    pool: PoolInfo, request_id: str, rendered: RenderedChat, *, session: str | None = None, ticket: Ticket | None = None, tokens: int = 0,
    cache_salt: int = 0,
) -> Placement:
    """Reserve the generation endpoint for a chat request; a `cache_aware` pool also says how
    much of the prompt that endpoint is expected to hold (TensorRT-LLM's `match_length`).
    `tokens` (prompt + max_tokens) count against capped endpoints' `capacity_tokens`;
    `cache_salt` is the prompt's tenant in the prefix index (`Prompt`)."""
    if pool.routing != RoutingPolicy.CACHE_AWARE:
        return Placement(await reserve(pool, Role.GENERATION, request_id, session=session, ticket=ticket, tokens=tokens))
    index = get_index()
    index.retain(pool.name, [e.id for e in pool.endpoints if _keeps_cache(e)])
    prompt = Prompt(rendered, settings.PREFIX_INDEX_CHUNK_BYTES, salt=cache_salt)
    matches: dict[int, int] = {}
    # Endpoints scored by what their engines' KV-cache events say they hold (empty while no
    # endpoint publishes events: nothing more per request).
    event_fed: set[int] = set()

    def usable(fresh: bool) -> list[EndpointInfo]:
        endpoints = _usable(_current(pool) if fresh else pool, Role.GENERATION, ())
        unscored = [e.id for e in endpoints if e.id not in matches]
        matches.update(index.matches(unscored, prompt))
        if kv_events.view:
            held = _held_by_events(unscored, prompt)
            matches.update(held)
            event_fed.update(held)
        return endpoints

    def pick(roomy: list[EndpointInfo]) -> EndpointInfo:
        return _cache_aware(pool, roomy, {e.id: matches[e.id] for e in roomy}, prompt, session)

    endpoint, lease = await admit(
        (pool.name, Role.GENERATION), ticket or Ticket(), usable, pick, tokens=tokens, held_here=_held_here
    )
    held = matches[endpoint.id] if endpoint.id in event_fed else index.held(endpoint.id, prompt, sent=matches[endpoint.id])
    index.record(endpoint.id, pool.name, prompt.key)
    health.on_routed(endpoint.id)
    if kv_events.view:  # empty while no endpoint publishes events: nothing more per request
        kv_events.on_routed(endpoint.id)
    reservation = Reservation.take(
        request_id, endpoint, Role.GENERATION, tokens=tokens if endpoint.capped else 0, reservation_id=lease, flow=ticket.flow if ticket else ""
    )
    return Placement(reservation, held, prompt.size, prompt)


def _held_by_events(endpoint_ids: list[int], prompt: Prompt) -> dict[int, int]:
    """Bytes of the prompt each endpoint's engine holds, by its KV-cache events: for endpoints
    whose events are trusted, once an earlier prompt of this conversation was learned
    (`KvEvents.known_prefix`): that prompt's bytes, scaled by the share of its leading blocks
    the engine holds. The others keep the approximate index's match."""
    held: dict[int, int] = {}
    for endpoint_id in endpoint_ids:
        blocks = kv_events.trusted(endpoint_id)
        if blocks is None:
            continue
        known = kv_events.known_prefix(blocks, prompt)
        if known is not None:
            size, keys = known
            held[endpoint_id] = size * blocks.leading(keys) // len(keys)
    return held


def _cache_aware(
    pool: PoolInfo, usable: list[EndpointInfo], matches: Mapping[int, int], prompt: Prompt, session: str | None
) -> EndpointInfo:
    best = max(matches.values())
    if best > prompt.shared_bytes:
        # This conversation has been here: the endpoint holding the most of it (ties: the least
        # loaded, then round robin).
        chosen = _least_loaded(pool, Role.GENERATION, [e for e in usable if matches[e.id] == best], None)
    else:
        # Nothing beyond what every conversation shares: a new conversation (or one no longer
        # held anywhere) goes to the less busy of its two rendezvous endpoints, busy meaning the
        # requests queued in its engine (as it reports them: work no gateway process counts, such
        # as outside traffic, under the load guard's threshold), then the conversations it
        # serves, then its open requests (two choices, as the power-of-two policy: conversations
        # spread evenly, and gateway processes always agree on which two).
        ranked = _rendezvous_ranked(session.encode() if session else prompt.root, usable)[:2]
        index = get_index()
        chosen = min(ranked, key=lambda e: (_queued(e), index.conversations(e.id), _load(e)))
    return _guarded(pool, Role.GENERATION, usable, chosen)


def _guarded(pool: PoolInfo, role: str, usable: list[EndpointInfo], chosen: EndpointInfo) -> EndpointInfo:
    """SGLang's load guard, applied to the chosen endpoint: a cache hit is not worth queueing
    behind a much busier worker."""
    lowest = min(_load(e) for e in usable)
    load = _load(chosen)
    if load - lowest > settings.PREFIX_BALANCE_ABS_THRESHOLD and load > settings.PREFIX_BALANCE_REL_THRESHOLD * lowest:
        return _least_loaded(pool, role, usable, None)
    return chosen


def _by_cache(pool: PoolInfo, role: str, usable: list[EndpointInfo], prompt: Prompt) -> EndpointInfo:
    """The endpoint that was sent the most of the prompt (ties and no match: the least loaded),
    under the load guard."""
    matches = get_index().matches([e.id for e in usable], prompt)
    best = max(matches.values())
    tied = [e for e in usable if matches[e.id] == best]
    return _guarded(pool, role, usable, _least_loaded(pool, role, tied, None))


def _keeps_cache(endpoint: EndpointInfo) -> bool:
    """Whether the endpoint probably still holds what it was sent: it is in the pool, enabled,
    and not failing its health probe (a draining endpoint keeps its cache)."""
    return health.usable(replace(endpoint, draining=False))


def choose_pool(served: Sequence[Served], tokens: int = 0) -> Served:
    """Spill-over across the pools that serve one model name, in preference order: the first
    whose generation role has a usable endpoint with room now (and no queue before it), else the
    first with any usable one (the request waits there for a slot), else the first with endpoints
    only slow to answer their probes (`workers.routing.fallback`), else the first (which answers
    that nothing is available)."""
    queue = get_queue()
    holding = engine_loads.holding  # endpoints whose engines' figures count them as full (admission)
    waiting_room: Served | None = None
    for option in served:
        pool = _current(option.pool)
        usable = candidates(pool, Role.GENERATION)
        if not usable:
            continue
        if not queue.busy((pool.name, Role.GENERATION)) and any(
            not (holding and engine_loads.holds(e.id)) and (not e.capped or fits_here(e, *_held_here(e.id), tokens)) for e in usable
        ):
            return option
        if waiting_room is None:
            waiting_room = option
    if waiting_room is None:
        waiting_room = next((o for o in served if fallback.slow_only(_current(o.pool), Role.GENERATION)), None)
    return waiting_room or served[0]


def candidates(pool: PoolInfo, role: str, exclude: Iterable[str] = ()) -> list[EndpointInfo]:
    """Endpoints of `role` that may take a new request now (enabled, not draining, healthy,
    breaker closed), minus `exclude` (URLs already tried for this request)."""
    excluded = set(exclude)
    return [e for e in pool.endpoints if e.role == role and e.url not in excluded and health.usable(e)]


def routable(pool: PoolInfo, role: str) -> list[EndpointInfo]:
    """The endpoints of `role` a new request may go to: `candidates`, or, with none, those taken
    despite probes that only time out (`workers.routing.fallback`). Readiness asks this."""
    return candidates(pool, role) or fallback.slow_only(pool, role)


async def reserve(
    pool: PoolInfo,
    role: str,
    request_id: str,
    *,
    session: str | None = None,
    exclude: Iterable[str] = (),
    placement: Placement | None = None,
    ticket: Ticket | None = None,
    tokens: int = 0,
) -> Reservation:
    """Reserve a routable endpoint of `role` in `pool` with room for the request (waiting in the
    admission queue while every one is at capacity), or raise NoEndpointAvailable.

    With the request's generation `placement` from a `cache_aware` pool, the context phase goes
    where the most of its prompt was sent (its KV may still be there), and the index records it."""
    prompt = placement.prompt if placement is not None and role == Role.CONTEXT else None
    excluded = tuple(exclude)

    def pick(usable: list[EndpointInfo]) -> EndpointInfo:
        if excluded:
            # A retry: the least loaded of the others, leaving the policy's rotation untouched so
            # that a failing endpoint does not shift every later request's turn.
            return min(usable, key=_load)
        if prompt is not None:
            return _by_cache(pool, role, usable, prompt)
        policy = POLICIES.get(pool.routing, _round_robin)
        # Affinity matters for generation (its prefix cache); the context phase is stateless.
        return policy(pool, role, usable, session if role == "generation" else None)

    endpoint, lease = await admit(
        (pool.name, role), ticket or Ticket(), lambda fresh: _usable(_current(pool) if fresh else pool, role, excluded), pick,
        tokens=tokens, held_here=_held_here,
    )
    if prompt is not None:
        # Only generation endpoints' conversations are compared (the balance guard).
        get_index().record(endpoint.id, pool.name, prompt.key, conversation=False)
    health.on_routed(endpoint.id)
    if kv_events.view:
        kv_events.on_routed(endpoint.id)
    return Reservation.take(
        request_id, endpoint, role, tokens=tokens if endpoint.capped else 0, reservation_id=lease, flow=ticket.flow if ticket else ""
    )


def _held_here(endpoint_id: int) -> tuple[int, int]:
    return ledger.open_count(endpoint_id), ledger.tokens(endpoint_id)


def _current(pool: PoolInfo) -> PoolInfo:
    """The pool as the registry holds it now: a request waiting for a slot sees capacities,
    health and the other processes' load change."""
    snapshot = get_registry().current()
    if snapshot is not None:
        for current in snapshot.pools:
            if current.id == pool.id:
                return current
    return pool


def _usable(pool: PoolInfo, role: str, exclude: Iterable[str]) -> list[EndpointInfo]:
    usable = candidates(pool, role, exclude)
    if not usable:
        # Nothing passes: endpoints only slow to answer their probes, else a refusal whose
        # reasons go to the log (`workers.routing.fallback`).
        usable = fallback.despite_probes(pool, role, exclude)
        if not usable:
            raise fallback.nothing_usable(pool, role, exclude)
    return usable
