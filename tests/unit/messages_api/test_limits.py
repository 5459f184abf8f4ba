"""Per-key limits: the rules (token buckets per minute, calendar budgets, concurrency), the
headers and the 429 they make, and the Redis script against the in-process state on the same
sequences (hypothesis drives both and compares every decision)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import pytest
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg_project.shared_state import get_shared_state
from messages_api.errors import AnthropicError
from messages_api.limits import check_limits, local_limits, rate_limit_headers
from messages_api.limits import shared as shared_limits
from messages_api.limits.local import LocalLimits
from messages_api.limits.policy import KeyLimits, Usage, window_end, window_id
from tests.support.redis import redis_url_or_skip

# The clock the checks are given: today's, since Redis expires keys by its own (a time in the past
# would expire them at once).
NOW = float(int(time.time()))


def check(state: LocalLimits, limits: KeyLimits, usage: Usage, now: float = NOW, lease: str = "l") -> tuple[bool, str, float]:
    decision = state.check("k", limits, usage, lease, math.inf, now)
    return decision.admitted, decision.refused_by, decision.retry_after_s


def test_a_request_bucket_refills_at_its_rate() -> None:
    state = LocalLimits()
    limits = KeyLimits(requests_per_minute=2)
    assert check(state, limits, Usage())[0]
    assert check(state, limits, Usage())[0]
    admitted, refused_by, wait = check(state, limits, Usage())
    assert (admitted, refused_by) == (False, "requests") and wait == pytest.approx(30.0)
    assert check(state, limits, Usage(), now=NOW + 30)[0]  # half a minute: one request back


def test_a_token_bucket_takes_the_whole_cost_and_needs_at_most_its_size() -> None:
    state = LocalLimits()
    limits = KeyLimits(input_tokens_per_minute=600)
    assert check(state, limits, Usage(input_tokens=2000))[0]  # bigger than the bucket: admitted when full
    admitted, refused_by, wait = check(state, limits, Usage(input_tokens=10))
    assert not admitted and refused_by == "input_tokens"
    assert wait == pytest.approx((10 + 1400) / 10)  # owes 1400, needs 10 more, refills 10/s


def test_settling_corrects_the_output_estimate() -> None:
    state = LocalLimits()
    limits = KeyLimits(output_tokens_per_minute=1000)
    assert check(state, limits, Usage(output_tokens=1000))[0]  # max_tokens 1000 estimated
    assert not check(state, limits, Usage(output_tokens=100))[0]
    state.settle("k", limits, Usage(output_tokens=1000), Usage(output_tokens=50), "l", NOW)
    assert check(state, limits, Usage(output_tokens=100))[0]  # 950 paid back


def test_a_budget_is_spent_when_answers_end_and_renews_with_its_window() -> None:
    state = LocalLimits()
    limits = KeyLimits(tokens_per_day=1000)
    assert check(state, limits, Usage(input_tokens=10))[0]
    state.settle("k", limits, Usage(input_tokens=10), Usage(input_tokens=600, output_tokens=400), "l", NOW)
    admitted, refused_by, wait = check(state, limits, Usage(input_tokens=10))
    assert (admitted, refused_by) == (False, "tokens_per_day")
    assert wait == pytest.approx(window_end("day", NOW) - NOW)
    assert check(state, limits, Usage(input_tokens=10), now=window_end("day", NOW) + 1)[0]


def test_concurrency_counts_requests_in_flight() -> None:
    state = LocalLimits()
    limits = KeyLimits(concurrency=2)
    assert check(state, limits, Usage(), lease="a")[0]
    assert check(state, limits, Usage(), lease="b")[0]
    assert check(state, limits, Usage(), lease="c")[1] == "concurrency"
    state.settle("k", limits, Usage(), Usage(), "a", NOW)
    assert check(state, limits, Usage(), lease="c")[0]


async def test_a_refusal_is_a_429_with_its_headers_and_a_short_retry_after() -> None:
    key = f"key-{uuid.uuid4().hex}"
    limits = KeyLimits(requests_per_minute=1, input_tokens_per_minute=1000)
    lease = await check_limits(key, limits, Usage(input_tokens=100, output_tokens=10))
    names = dict(lease.headers)
    assert names[b"anthropic-ratelimit-requests-limit"] == b"1"
    assert names[b"anthropic-ratelimit-requests-remaining"] == b"0"
    assert names[b"anthropic-ratelimit-input-tokens-remaining"] == b"900"
    assert names[b"anthropic-ratelimit-tokens-remaining"] == b"900"
    assert names[b"anthropic-ratelimit-requests-reset"].endswith(b"Z")
    with pytest.raises(AnthropicError) as refused:
        await check_limits(key, limits, Usage(input_tokens=100))
    error = refused.value
    assert (error.status, error.error_type) == (429, "rate_limit_error")
    assert error.retry_after is not None and 1 <= error.retry_after <= 59
    assert "1 requests per minute" in error.message
    assert dict(error.headers)[b"anthropic-ratelimit-requests-remaining"] == b"0"
    lease.settle(Usage(input_tokens=100))
    local_limits.forget()


async def test_an_exhausted_budget_says_so_and_when_it_renews() -> None:
    key = f"key-{uuid.uuid4().hex}"
    limits = KeyLimits(tokens_per_month=100)
    lease = await check_limits(key, limits, Usage(input_tokens=10))
    lease.settle(Usage(input_tokens=60, output_tokens=60))
    with pytest.raises(AnthropicError) as refused:
        await check_limits(key, limits, Usage(input_tokens=10))
    assert "monthly budget of 100 tokens is exhausted" in refused.value.message
    assert (refused.value.retry_after or 0) > 59  # long: Claude Code gives up rather than retry
    local_limits.forget()


async def test_a_key_without_limits_sends_no_headers() -> None:
    lease = await check_limits("unlimited", KeyLimits(), Usage(input_tokens=10))
    assert lease.headers == [] and lease.settled


def test_the_tokens_headers_name_the_most_restrictive_token_limit() -> None:
    state = LocalLimits()
    decision = state.check("k", KeyLimits(input_tokens_per_minute=1000, tokens_per_day=300), Usage(input_tokens=100), "l", math.inf, NOW)
    headers = dict(rate_limit_headers(decision.states))
    assert headers[b"anthropic-ratelimit-tokens-limit"] == b"300"


# --- the Redis script keeps the same rules -----------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["check", "settle"]),
        st.floats(min_value=0, max_value=40, allow_nan=False),  # seconds after the previous op
        st.integers(min_value=0, max_value=3000),  # input tokens
        st.integers(min_value=0, max_value=3000),  # output tokens
    ),
    max_size=25,
)
LIMITS = st.builds(
    KeyLimits,
    concurrency=st.one_of(st.none(), st.integers(1, 3)),
    requests_per_minute=st.one_of(st.none(), st.integers(1, 5)),
    input_tokens_per_minute=st.one_of(st.none(), st.integers(100, 5000)),
    output_tokens_per_minute=st.one_of(st.none(), st.integers(100, 5000)),
    tokens_per_day=st.one_of(st.none(), st.integers(100, 20000)),
)


@pytest.fixture
async def redis_limits() -> AsyncIterator[None]:
    url = redis_url_or_skip()
    with override_settings(REDIS_URL=url, REDIS_KEY_PREFIX=f"test-limits-{uuid.uuid4().hex}:"):
        yield
        await get_shared_state().aclose()


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limits=LIMITS, ops=OPS)
async def test_the_redis_script_decides_as_the_process_does(redis_limits: None, limits: KeyLimits, ops: list[tuple[str, float, int, int]]) -> None:
    local = LocalLimits()
    key = uuid.uuid4().hex
    now = NOW
    open_leases: list[tuple[str, Usage]] = []
    for op, gap, input_tokens, output_tokens in ops:
        now += gap
        if op == "check":
            lease = uuid.uuid4().hex
            usage = Usage(input_tokens, output_tokens)
            here = local.check(key, limits, usage, lease, math.inf, now)
            there = await shared_limits.check(key, limits, usage, lease, now + 3600, now)
            assert there is not None, "Redis did not answer"
            assert (there.admitted, there.refused_by) == (here.admitted, here.refused_by)
            assert there.retry_after_s == pytest.approx(here.retry_after_s, abs=1e-6)
            assert {n: s.remaining for n, s in there.states.items()} == {n: s.remaining for n, s in here.states.items()}
            if here.admitted:
                open_leases.append((lease, usage))
        elif open_leases:
            lease, estimate = open_leases.pop(0)
            actual = Usage(input_tokens, output_tokens)
            local.settle(key, limits, estimate, actual, lease, now)
            await _settled(key, limits, estimate, actual, lease, now)


@pytest.mark.parametrize("moment", ["2026-12-31T23:59:59.999", "2027-01-01T00:00:00", "2028-02-29T12:00:00", "2026-03-31T23:59:59"])
def test_the_windows_computed_once_a_day_are_the_requests_own(moment: str) -> None:
    now = datetime.fromisoformat(moment).replace(tzinfo=timezone.utc).timestamp()
    for t in (now, now - 1e-3, now + 1e-3):
        expected = (window_id("day", t), window_end("day", t), window_id("month", t), window_end("month", t))
        assert shared_limits._windows(int(t // 86400)) == expected


async def _settled(key: str, limits: KeyLimits, estimate: Usage, actual: Usage, lease: str, now: float) -> None:
    """`shared.settle`, waited for (it runs in the background in production)."""
    shared_limits.settle(key, limits, estimate, actual, lease, now)
    await get_shared_state().drain()


async def test_a_refused_key_is_refused_again_early_until_its_wait_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next request of a key just refused for a rate is answered before its body is parsed."""
    from messages_api import limits as limits_module

    key = f"key-{uuid.uuid4().hex}"
    limits = KeyLimits(requests_per_minute=1)
    clock = [NOW]
    monkeypatch.setattr(limits_module.time, "time", lambda: clock[0])
    lease = await check_limits(key, limits, Usage())
    with pytest.raises(AnthropicError):
        await check_limits(key, limits, Usage())
    with pytest.raises(AnthropicError) as early:
        limits_module.refuse_early(key, limits)
    assert early.value.status == 429 and 1 <= (early.value.retry_after or 0) <= 60
    clock[0] += 61  # the wait is over: the early check lets it through to the full one
    limits_module.refuse_early(key, limits)
    lease.settle(Usage())
    local_limits.forget()


async def test_as_many_in_flight_here_as_the_concurrency_is_refused_early() -> None:
    from messages_api import limits as limits_module

    key = f"key-{uuid.uuid4().hex}"
    limits = KeyLimits(concurrency=2, requests_per_minute=100)
    leases = [await check_limits(key, limits, Usage()) for _ in range(2)]
    with pytest.raises(AnthropicError) as early:
        limits_module.refuse_early(key, limits)
    assert "2 concurrent requests" in early.value.message
    assert dict(early.value.headers)[b"anthropic-ratelimit-requests-remaining"] == b"98"  # as last checked
    leases[0].settle(Usage())
    limits_module.refuse_early(key, limits)  # one ended: no longer refused early
    leases[1].settle(Usage())
    local_limits.forget()
