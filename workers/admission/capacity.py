"""Endpoint capacity: an endpoint takes at most `capacity` requests and `capacity_tokens` tokens
(each request's prompt + max_tokens) at once, across every gateway process.

With Redis (`REDIS_URL`) a slot is a lease in a sorted set per endpoint, taken by one atomic
script (one round trip) and released by another, in the background. Each process renews its
leases every third of `CAPACITY_LEASE_S`, so the slots of a process that dies free themselves
within that time (`disagg_project.shared_state.LeaseBook`). Without Redis, or while it fails, each process counts what it holds itself plus
what the others held at the last registry refresh (`EndpointInfo.remote_open`): exact within a
process, as fresh as the refresh across them.

An endpoint without a capacity costs nothing here: no lease, no round trip.
"""

from __future__ import annotations

import time

from django.conf import settings

from disagg_project import Script, get_shared_state
from disagg_project import shared_leases as leases
from workers.cluster.registry import EndpointInfo

# KEYS: leases (zset lease → expiry), tokens (hash lease → tokens)
# ARGV: now, expiry, lease, tokens, capacity (-1: none), capacity_tokens (-1: none)
_ACQUIRE = Script(
    """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1000)
if #expired > 0 then
  redis.call('ZREM', KEYS[1], unpack(expired))
  redis.call('HDEL', KEYS[2], unpack(expired))
end
local held = redis.call('ZCARD', KEYS[1])
local capacity = tonumber(ARGV[5])
if capacity >= 0 and held >= capacity then return 0 end
local capacity_tokens = tonumber(ARGV[6])
if capacity_tokens >= 0 and held > 0 then
  local total = tonumber(ARGV[4])
  for _, v in ipairs(redis.call('HVALS', KEYS[2])) do total = total + tonumber(v) end
  if total > capacity_tokens then return 0 end
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
-- The set lives while a lease in it is renewed; the hash's fields go with their expired leases.
redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(ARGV[2]) - tonumber(ARGV[1])) * 1000))
return 1
"""
)
_RELEASE = Script(
    """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""
)
def _keys(endpoint_id: int) -> list[str]:
    prefix = settings.REDIS_KEY_PREFIX
    return [f"{prefix}cap:{endpoint_id}:leases", f"{prefix}cap:{endpoint_id}:tokens"]


def fits_here(endpoint: EndpointInfo, open_here: int, tokens_here: int, tokens: int) -> bool:
    """Whether a request of `tokens` fits the endpoint as this process sees it (its own slots plus
    the other processes' at the last refresh). A request larger than the token capacity alone is
    admitted to an idle endpoint: it could never fit otherwise."""
    held = open_here + endpoint.remote_open
    if endpoint.capacity is not None and held >= endpoint.capacity:
        return False
    if endpoint.capacity_tokens is not None and held > 0 and tokens_here + tokens > endpoint.capacity_tokens:
        return False
    return True


async def acquire(endpoint: EndpointInfo, lease: str, tokens: int, open_here: int, tokens_here: int) -> bool:
    """Take a slot on a capped endpoint for `lease`: False when it is full."""
    shared = get_shared_state()
    if shared.available:
        now = time.time()
        keys = _keys(endpoint.id)
        result = await shared.run(
            _ACQUIRE,
            keys,
            [now, now + settings.CAPACITY_LEASE_S, lease, tokens,
             -1 if endpoint.capacity is None else endpoint.capacity,
             -1 if endpoint.capacity_tokens is None else endpoint.capacity_tokens],
        )
        if result is not None:
            if result:
                leases.hold(keys[0], lease)
            return bool(result)
    return fits_here(endpoint, open_here, tokens_here, tokens)


def release(endpoint: EndpointInfo, lease: str) -> None:
    """Give back a slot taken through Redis (a no-op for one counted only here)."""
    keys = _keys(endpoint.id)
    if leases.drop(keys[0], lease):
        get_shared_state().spawn(_RELEASE, keys, [lease])
