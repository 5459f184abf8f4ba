"""Engine-reported load as this process knows it: each endpoint's queue, running requests and
KV-cache use, read from the engine's own Prometheus metrics (`WorkerProtocol.metrics_path`).

A background service (`workers.cluster.services`) calls `engine_loads.poll_all` every
`ENGINE_LOAD_POLL_S`. Who reads which engine:

- with Redis (`REDIS_URL`), one process per endpoint: each poll starts with one script that, per
  endpoint, renews or takes a short lease (`_lease_ms`) when no other process holds it, and hands
  back what the holder last published. The holder reads the engine and publishes its figures with
  their time (`_PUBLISH`, in the background); the others take the published figures. A holder
  that dies lets its lease lapse within three polls, and another process takes over;
- without Redis, or while it fails, each process reads every engine itself.

Reading an engine: one GET within `ENGINE_LOAD_TIMEOUT_S`, at most `ENGINE_LOAD_MAX_BYTES` of
answer, parsed on a thread of its own: the scan of a whole scrape is not trivially cheap, and a
worker's answer is outside input (bench/engine_load_cpu.py measures both). A failed read publishes
nothing.

Routing asks `fresh(endpoint_id)`: the figures if they are younger than `ENGINE_LOAD_MAX_AGE_S`,
else None, and then routes on the gateway's own counts (`workers.routing.router._load`). Figures
going stale, or an engine whose metrics cannot be read, are logged once per change, and shown in
`/metrics` (`workers.cluster.metrics`) and the admin's overview (`workers.local_state`).

Admission asks `holds(endpoint_id)`: whether the engine's fresh figures say it takes no more for
now (`holds_admission`: its queue at `ENGINE_LOAD_ADMIT_MAX_WAITING`, or its KV cache at
`ENGINE_LOAD_ADMIT_MAX_KV_USAGE`; both off by default). Such an endpoint counts as full, and
requests wait in the gateway's admission queue (`workers.admission`) rather than the engine's
FIFO; `poll_all` returns the resources where an endpoint stopped holding, whose waiters the
caller wakes. Stale figures hold nothing: the gateway's own counts decide, as in routing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
from django.conf import settings

from disagg_project import GATEWAY_INSTANCE, Script, get_shared_state
from workers.cluster.registry import EndpointInfo, PoolInfo, get_registry
from workers.exceptions import WorkerError
from workers.protocols import lookup
from workers.protocols.engine_load import EngineLoad
from workers.wire import client

logger = logging.getLogger(__name__)

# Per endpoint: KEYS lease, figures (in pairs); ARGV: this process, the lease's length (ms).
# Returns per endpoint: 1 when this process holds the lease (it reads the engine), else 0; then
# the figures last published ('' when none).
_CLAIM = Script(
    """
local out = {}
for i = 1, #KEYS, 2 do
  local holder = redis.call('GET', KEYS[i])
  if (not holder) or holder == ARGV[1] then
    redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  out[#out + 1] = redis.call('GET', KEYS[i + 1]) or ''
end
return out
"""
)
# KEYS: figures keys; ARGV: their time to live (ms), then one JSON value per key.
_PUBLISH = Script(
    """
for i = 1, #KEYS do redis.call('SET', KEYS[i], ARGV[i + 1], 'PX', ARGV[1]) end
return 1
"""
)

# Parsing runs here, off the event loop (one thread: polls are seconds apart).
_PARSER = ThreadPoolExecutor(1, thread_name_prefix="engine-load")


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """The last figures this process has for one endpoint."""

    load: EngineLoad
    #: Wall-clock time the engine was read (by this process or the one that published them).
    read_at: float
    #: `time.monotonic()` past which the figures are too old to route on.
    fresh_until: float
    #: This process read the engine itself (False: another process's figures, through Redis).
    polled_here: bool
    #: What routing counts (`workers.routing.router._load`), worked out once per reading rather
    #: than per request: the engine's waiting + running, and the requests its KV use adds.
    requests: int = 0
    kv_penalty: int = 0
    #: Admission counts the endpoint as full while these figures are fresh (`holds_admission`).
    holds_admission: bool = False

    @property
    def fresh(self) -> bool:
        return time.monotonic() < self.fresh_until

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.read_at)


class EngineLoads:
    """Every endpoint's engine load as this process knows it (one per process, `engine_loads`)."""

    def __init__(self) -> None:
        #: By endpoint id. Empty while polling is off: routing then reads nothing here.
        self.view: dict[int, EndpointLoad] = {}
        #: Reads of each endpoint's engine made here, by outcome ("ok", "failed", "unreadable").
        self.polls: dict[int, Counter[str]] = {}
        # Endpoints whose last read here failed, with why (logged once per change).
        self._failing: dict[int, str] = {}
        # Endpoints whose figures were fresh at the last poll (a change is logged).
        self._was_fresh: dict[int, bool] = {}
        #: Endpoints whose figures held admission, fresh, at the last poll (`holds`). Empty while
        #: the admission settings are off: admission then looks nothing else up.
        self.holding: frozenset[int] = frozenset()

    # --- routing -----------------------------------------------------------------------------------

    def fresh(self, endpoint_id: int) -> EndpointLoad | None:
        """The endpoint's figures if fresh enough to route on, else None."""
        entry = self.view.get(endpoint_id)
        if entry is None or time.monotonic() >= entry.fresh_until:
            return None
        return entry

    def holds(self, endpoint_id: int) -> bool:
        """Whether admission counts the endpoint as full: its engine's fresh figures report a queue
        or a KV use at the admission settings (`holds_admission`). Callers look only when
        `holding` is not empty."""
        return endpoint_id in self.holding and self.fresh(endpoint_id) is not None

    def error(self, endpoint_id: int) -> str:
        """Why this process's last read of the endpoint's engine failed ("" when it did not)."""
        return self._failing.get(endpoint_id, "")

    # --- collection ----------------------------------------------------------------------------------

    async def poll_all(self) -> set[tuple[str, str]]:
        """Read (or take) every endpoint's figures; the admission resources (pool, role) where an
        endpoint stopped holding admission, whose waiters may go now."""
        snapshot = await get_registry().snapshot()
        targets = {e.id: (e, pool) for pool in snapshot.pools if _reads_load(pool) for e in pool.endpoints if e.enabled}
        for gone in [i for i in self.view if i not in targets]:
            del self.view[gone]
        for table in (self.polls, self._failing, self._was_fresh):
            for gone in [i for i in table if i not in targets]:
                del table[gone]
        if targets:
            mine = await self._claim(targets.values())
            read = await asyncio.gather(*(self._read(endpoint, pool) for endpoint, pool in mine))
            published = [(endpoint, entry) for (endpoint, _), entry in zip(mine, read, strict=True) if entry is not None]
            if published and get_shared_state().available:
                _publish(published)
            self._note_freshness()
        return self._note_holding(targets)

    def _note_holding(self, targets: dict[int, tuple[EndpointInfo, PoolInfo]]) -> set[tuple[str, str]]:
        holding = frozenset(i for i, entry in self.view.items() if entry.holds_admission and entry.fresh)
        released = {(targets[i][0].pool_name, targets[i][0].role) for i in self.holding - holding if i in targets}
        self.holding = holding
        return released

    async def _claim(self, targets: Iterable[tuple[EndpointInfo, PoolInfo]]) -> list[tuple[EndpointInfo, PoolInfo]]:
        """The endpoints this process reads itself; the others' published figures are stored."""
        targets = list(targets)
        shared = get_shared_state()
        if not shared.available:
            return targets
        keys = [key for endpoint, _ in targets for key in _keys(endpoint.id)]
        result = await shared.run(_CLAIM, keys, [GATEWAY_INSTANCE, _lease_ms()])
        if not isinstance(result, list) or len(result) != 2 * len(targets):
            return targets  # Redis failed: read every engine here
        mine = []
        for (endpoint, pool), held, figures in zip(targets, result[0::2], result[1::2], strict=True):
            if held == 1:
                mine.append((endpoint, pool))
            else:
                self._take_published(endpoint.id, figures)
        return mine

    def _take_published(self, endpoint_id: int, figures: Any) -> None:
        if not figures:
            return  # none published (its holder cannot read the engine): what was kept ages
        try:
            data = orjson.loads(figures)
            load = EngineLoad(int(data["w"]), int(data["r"]), None if data["kv"] is None else float(data["kv"]))
            read_at = float(data["at"])
        except (orjson.JSONDecodeError, TypeError, KeyError, ValueError):
            return  # not figures this code published: what was kept ages
        current = self.view.get(endpoint_id)
        if current is None or read_at > current.read_at:
            self.view[endpoint_id] = _entry(load, read_at, polled_here=False)

    async def _read(self, endpoint: EndpointInfo, pool: PoolInfo) -> EndpointLoad | None:
        protocol = lookup(pool.protocol)
        assert protocol is not None and protocol.metrics_path is not None  # _reads_load
        polls = self.polls.setdefault(endpoint.id, Counter())
        try:
            text = await client.get_text(
                endpoint.url.rstrip("/") + protocol.metrics_path, timeout=settings.ENGINE_LOAD_TIMEOUT_S,
                limit=settings.ENGINE_LOAD_MAX_BYTES, stage="metrics",
            )
            read_at = time.time()
            load = await asyncio.get_running_loop().run_in_executor(_PARSER, protocol.read_load, text, pool.model)
        except WorkerError as error:
            polls["failed"] += 1
            self._failed(endpoint, error.message)
            return None
        if load is None:
            polls["unreadable"] += 1
            self._failed(endpoint, f"its {protocol.metrics_path} has no {protocol.name} load figures")
            return None
        polls["ok"] += 1
        if self._failing.pop(endpoint.id, None) is not None:
            logger.warning("the engine load of endpoint %s is readable again", endpoint.url)
        entry = self.view[endpoint.id] = _entry(load, read_at, polled_here=True)
        return entry

    def _failed(self, endpoint: EndpointInfo, why: str) -> None:
        if endpoint.id not in self._failing:
            logger.warning(
                "cannot read the engine load of endpoint %s (%s): routing uses the gateway's own counts for it", endpoint.url, why
            )
        self._failing[endpoint.id] = why

    def _note_freshness(self) -> None:
        for endpoint_id, entry in self.view.items():
            fresh = entry.fresh
            if self._was_fresh.get(endpoint_id, True) != fresh:
                if fresh:
                    logger.warning("engine load of endpoint #%s is fresh again", endpoint_id)
                else:
                    logger.warning(
                        "engine load of endpoint #%s is %.0f s old: routing uses the gateway's own counts for it",
                        endpoint_id, entry.age_s,
                    )
            self._was_fresh[endpoint_id] = fresh


def _reads_load(pool: PoolInfo) -> bool:
    protocol = lookup(pool.protocol)
    return protocol is not None and protocol.metrics_path is not None and protocol.load_metrics is not None


def _entry(load: EngineLoad, read_at: float, *, polled_here: bool) -> EndpointLoad:
    age = max(0.0, time.time() - read_at)
    return EndpointLoad(
        load, read_at, time.monotonic() + settings.ENGINE_LOAD_MAX_AGE_S - age, polled_here, load.requests, kv_penalty(load.kv_usage),
        holds_admission(load, settings.ENGINE_LOAD_ADMIT_MAX_WAITING, settings.ENGINE_LOAD_ADMIT_MAX_KV_USAGE),
    )  # fmt: skip


def holds_admission(load: EngineLoad, max_waiting: int, max_kv_usage: float) -> bool:
    """Whether an engine reporting `load` should take no more requests from the gateway for now:
    its own queue holds at least `max_waiting` requests, or its KV cache is at least `max_kv_usage`
    full (0 turns either test off). The requests wait in the gateway's queue instead, where the
    keys' priorities and fair shares order them; the engine's FIFO orders by arrival only."""
    if max_waiting > 0 and load.waiting >= max_waiting:
        return True
    return max_kv_usage > 0 and load.kv_usage is not None and load.kv_usage >= max_kv_usage


def kv_penalty(kv_usage: float | None) -> int:
    """The requests a nearly full KV cache counts as: none up to ENGINE_LOAD_KV_THRESHOLD, rising
    to ENGINE_LOAD_KV_PENALTY at a full cache (new requests there evict others' blocks or wait)."""
    threshold = settings.ENGINE_LOAD_KV_THRESHOLD
    if kv_usage is None or kv_usage <= threshold or threshold >= 1:
        return 0
    return math.ceil(settings.ENGINE_LOAD_KV_PENALTY * (kv_usage - threshold) / (1 - threshold))


def _keys(endpoint_id: int) -> tuple[str, str]:
    prefix = settings.REDIS_KEY_PREFIX
    return f"{prefix}eload:{endpoint_id}:lease", f"{prefix}eload:{endpoint_id}:figures"


def _lease_ms() -> int:
    # Three polls: a holder that misses one (a slow engine, a busy loop) keeps it.
    return max(1000, int(settings.ENGINE_LOAD_POLL_S * 3000))


def _publish(entries: list[tuple[EndpointInfo, EndpointLoad]]) -> None:
    keys = [_keys(endpoint.id)[1] for endpoint, _ in entries]
    values = [
        orjson.dumps({"w": e.load.waiting, "r": e.load.running, "kv": e.load.kv_usage, "at": e.read_at}).decode() for _, e in entries
    ]
    get_shared_state().spawn(_PUBLISH, keys, [int(settings.ENGINE_LOAD_MAX_AGE_S * 1000) + 1, *values])


engine_loads = EngineLoads()
