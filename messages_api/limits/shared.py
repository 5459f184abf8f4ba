"""The per-key limits kept in Redis, shared by every gateway process: one script checks every
limit of a key and takes what the request costs, atomically, in one round trip; another settles
the request when it ends. The rules are `messages_api.limits.local`'s, line for line."""

from __future__ import annotations

import functools
from typing import Any

from django.conf import settings

from disagg_project import Script, get_shared_state, shared_leases
from messages_api.limits.policy import BucketState, Decision, KeyLimits, Usage, bucket_state, costs, window_end, window_id

# KEYS: buckets (hash), leases (zset), day usage, month usage
# ARGV: now, lease, lease expiry, concurrency,
#       then per bucket (requests, input_tokens, output_tokens): limit, cost,
#       then day budget, day window end, month budget, month window end   (-1: no such limit)
# → {admitted, refused_by, wait, level requests, level input, level output, used day, used month}
_CHECK = Script(
    """
local now = tonumber(ARGV[1])
local names = {'requests', 'input_tokens', 'output_tokens'}
local refused, wait = '', 0
local levels = {}
for i = 1, 3 do
  local limit = tonumber(ARGV[3 + 2 * i])
  if limit >= 0 then
    local level = tonumber(redis.call('HGET', KEYS[1], names[i] .. ':l') or limit)
    local updated = tonumber(redis.call('HGET', KEYS[1], names[i] .. ':t') or now)
    level = math.min(limit, level + math.max(0, now - updated) * limit / 60)
    levels[i] = level
    local need = math.min(tonumber(ARGV[4 + 2 * i]), limit)
    if level < need then
      local w = (need - level) * 60 / limit
      if w > wait then refused, wait = names[i], w end
    end
  end
end
local used = {0, 0}
for j = 1, 2 do
  local budget = tonumber(ARGV[9 + 2 * j])
  if budget >= 0 then
    used[j] = tonumber(redis.call('GET', KEYS[2 + j]) or 0)
    if used[j] >= budget then
      local w = tonumber(ARGV[10 + 2 * j]) - now
      local kind = (j == 1) and 'day' or 'month'
      if w > wait or refused == '' then refused, wait = 'tokens_per_' .. kind, math.max(wait, w) end
    end
  end
end
local concurrency = tonumber(ARGV[4])
if concurrency >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= concurrency and refused == '' then refused, wait = 'concurrency', 1 end
end
local admitted = refused == ''
local out = {admitted and 1 or 0, refused, string.format('%.17g', wait)}
for i = 1, 3 do
  local limit = tonumber(ARGV[3 + 2 * i])
  if limit >= 0 then
    local level = levels[i] - (admitted and tonumber(ARGV[4 + 2 * i]) or 0)
    redis.call('HSET', KEYS[1], names[i] .. ':l', string.format('%.17g', level), names[i] .. ':t', string.format('%.17g', now))
    out[3 + i] = string.format('%.17g', level)
  else
    out[3 + i] = ''
  end
end
redis.call('EXPIRE', KEYS[1], 3600)
if admitted and concurrency >= 0 then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
  redis.call('EXPIREAT', KEYS[2], math.ceil(tonumber(ARGV[3])) + 60)
end
out[7] = tostring(used[1])
out[8] = tostring(used[2])
return out
"""
)

# KEYS: buckets, leases, day usage, month usage
# ARGV: now, lease, input limit, input correction, output limit, output correction, spent,
#       day budget, day window end, month budget, month window end
_SETTLE = Script(
    """
local now = tonumber(ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[2])
local names = {'input_tokens', 'output_tokens'}
for i = 1, 2 do
  local limit = tonumber(ARGV[1 + 2 * i])
  local level = redis.call('HGET', KEYS[1], names[i] .. ':l')
  if limit >= 0 and level then
    local updated = tonumber(redis.call('HGET', KEYS[1], names[i] .. ':t') or now)
    level = math.min(limit, tonumber(level) + math.max(0, now - updated) * limit / 60)
    level = math.min(limit, level - tonumber(ARGV[2 + 2 * i]))
    redis.call('HSET', KEYS[1], names[i] .. ':l', string.format('%.17g', level), names[i] .. ':t', string.format('%.17g', now))
  end
end
local spent = tonumber(ARGV[7])
for j = 1, 2 do
  if tonumber(ARGV[6 + 2 * j]) >= 0 and spent > 0 then
    redis.call('INCRBY', KEYS[2 + j], spent)
    redis.call('EXPIREAT', KEYS[2 + j], math.ceil(tonumber(ARGV[7 + 2 * j])) + 86400)
  end
end
return 1
"""
)


@functools.lru_cache(maxsize=4)
def _windows(day: int) -> tuple[str, float, str, float]:
    """The UTC day's and month's window ids and ends for the day `day` (epoch days: a Unix day is
    86,400 s, and months start on days), computed once a day instead of on every request."""
    now = day * 86400.0
    return window_id("day", now), window_end("day", now), window_id("month", now), window_end("month", now)


def _keys(key: str, windows: tuple[str, float, str, float]) -> list[str]:
    prefix = f"{settings.REDIS_KEY_PREFIX}key:{key}:"
    return [prefix + "b", prefix + "c", prefix + "d:" + windows[0], prefix + "m:" + windows[2]]


def _limit(value: int | None) -> int:
    return -1 if value is None else value


async def check(key: str, limits: KeyLimits, estimate: Usage, lease: str, lease_expiry: float, now: float) -> Decision | None:
    """The decision, or None when Redis cannot be asked (the caller falls back to its own state)."""
    wanted = costs(estimate)
    windows = _windows(int(now // 86400))
    day_end, month_end = windows[1], windows[3]
    args: list[Any] = [now, lease, lease_expiry, _limit(limits.concurrency)]
    for name, limit in limits.buckets:
        args += [_limit(limit), wanted[name]]
    args += [_limit(limits.tokens_per_day), day_end, _limit(limits.tokens_per_month), month_end]
    keys = _keys(key, windows)
    result = await get_shared_state().run(_CHECK, keys, args)
    if result is None:
        return None
    admitted, refused_by, wait, *levels = (v.decode() if isinstance(v, bytes) else v for v in result)
    states: dict[str, BucketState] = {}
    for (name, limit), level in zip(limits.buckets, levels[:3], strict=True):
        if limit is not None:
            states[name] = bucket_state(float(level), limit, now)
    for kind, budget, used, end in (("day", limits.tokens_per_day, levels[3], day_end), ("month", limits.tokens_per_month, levels[4], month_end)):
        if budget is not None:
            states[f"tokens_per_{kind}"] = BucketState(budget, max(0, budget - int(float(used))), end)
    if admitted and limits.concurrency is not None:
        shared_leases.hold(keys[1], lease)
    return Decision(bool(int(admitted)), states, str(refused_by), float(wait))


def settle(key: str, limits: KeyLimits, estimate: Usage, actual: Usage, lease: str, now: float) -> None:
    """Correct the estimate and count the tokens, in the background."""
    windows = _windows(int(now // 86400))
    keys = _keys(key, windows)
    shared_leases.drop(keys[1], lease)
    args = [
        now, lease,
        _limit(limits.input_tokens_per_minute), actual.input_tokens - estimate.input_tokens,
        _limit(limits.output_tokens_per_minute), actual.output_tokens - estimate.output_tokens,
        actual.input_tokens + actual.output_tokens,
        _limit(limits.tokens_per_day), windows[1], _limit(limits.tokens_per_month), windows[3],
    ]
    get_shared_state().spawn(_SETTLE, keys, args)
