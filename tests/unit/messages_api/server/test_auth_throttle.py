"""Failed authentications per address (messages_api/server/auth_throttle.py): a burst of the budget,
then one per interval; retry-after says when; bounded memory whatever addresses arrive; IPv6 counted
by its /64."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from messages_api.server.auth_throttle import FailureThrottle, address_key


def test_the_budget_at_once_then_one_per_interval() -> None:
    throttle = FailureThrottle(per_minute=6)  # 6 at once, then one each 10 s
    now = 1000.0
    for _ in range(6):
        assert throttle.retry_after("203.0.113.1", now) is None
        throttle.failed("203.0.113.1", now)
    assert throttle.retry_after("203.0.113.1", now) == 10
    assert throttle.retry_after("203.0.113.1", now + 9.5) == 1
    assert throttle.retry_after("203.0.113.2", now) is None  # another address: its own budget
    assert throttle.retry_after("203.0.113.1", now + 10) is None  # one more failure allowed
    throttle.failed("203.0.113.1", now + 10)
    assert throttle.retry_after("203.0.113.1", now + 10) == 10
    assert throttle.retry_after("203.0.113.1", now + 60) is None


def test_zero_never_throttles() -> None:
    throttle = FailureThrottle(per_minute=0)
    for _ in range(1000):
        throttle.failed("203.0.113.1", 0.0)
    assert throttle.retry_after("203.0.113.1", 0.0) is None and len(throttle) == 0


def test_memory_is_bounded_the_oldest_failure_out_first() -> None:
    throttle = FailureThrottle(per_minute=1, addresses_kept=100)
    throttle.failed("198.51.100.1", 0.0)
    for i in range(10_000):
        throttle.failed(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 1.0)
        assert len(throttle) <= 100
    assert throttle.retry_after("198.51.100.1", 1.0) is None  # pushed out: the price of the bound
    assert throttle.retry_after("10.0.39.15", 1.0) is not None  # the most recent are kept


@given(st.lists(st.tuples(st.ip_addresses().map(str), st.floats(0, 1e6)), max_size=300), st.integers(1, 50))
def test_never_more_addresses_than_kept(failures: list[tuple[str, float]], kept: int) -> None:
    throttle = FailureThrottle(per_minute=5, addresses_kept=kept)
    for address, at in failures:
        throttle.failed(address, at)
        assert len(throttle) <= kept


def test_an_ipv6_host_counts_by_its_64() -> None:
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:203.0.113.7") == "203.0.113.7"
    assert address_key("203.0.113.7") == "203.0.113.7"
    throttle = FailureThrottle(per_minute=2)
    throttle.failed("2001:db8::1", 0.0)
    throttle.failed("2001:db8::2", 0.0)
    assert throttle.retry_after("2001:db8::ffff", 0.0) is not None
