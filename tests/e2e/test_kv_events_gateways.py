"""Two gateway processes agree on where a conversation's prefix is (issue 44 part 5): two real
daphne gateways sharing one Redis (`REDIS_URL`, a key prefix of this test's own), two sim
workers publishing vLLM's KV-cache events, Anthropic requests.

- turn 1 goes through gateway A, which learns its prompt's blocks from the worker's answer; turn 2
  goes through gateway B, which never saw the conversation, and still goes to the engine whose
  events say it holds turn 1: B keeps what A learned, from the shared stream. The holder reports
  a little outside load (under the load guard), so B's own approximate index would send the turn
  to the idle engine: the control test shows it does, without the sharing;
- after the holder's prefix cache is reset (and the conversation's prompt lands on the other
  engine from outside), both gateways send the next turn to the other engine, although each one's
  own index says it sent the conversation to the holder.

The agreeing test runs twice: with both gateways on this host, and with each on a host of its own
(`two hosts`: network namespaces, tests/support/netns.py). There the gateways' only way to the
engines, the Redis and the database is their link to the bridge: the engines listen on the
bridge's address, the Redis is the test's own there, and the database is a file or relayed.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.cluster import wait_until
from tests.support.gateway import Gateway
from tests.support.kv_events import Engine, counter, kv, received, register_pool, start_engine, turn
from tests.support.netns import Network, database_url, network, redis_server
from tests.support.redis import redis_url_or_skip
from tests.support.simworkers import SimWorker

OUTSIDE_QUEUE = 2  # requests: below the cache-aware load guard (PREFIX_BALANCE_ABS_THRESHOLD, 4)
LEARNED = "gateway_kv_events_prompts_learned_total"
RECEIVED = "gateway_kv_events_prompts_received_total"


@dataclass
class Place:
    """Where the test's processes run: the address the engines listen on, the Redis, and the two
    gateways' hosts (`net`: none, both on this host)."""

    engines: str
    redis: str
    net: Network | None = None
    database: str = ""

    def gateway(self, i: int, env: dict[str, str]) -> Gateway:
        if self.net is None:
            return Gateway(env)
        return self.net.gateway(("hostA", "hostB")[i], {**env, "DATABASE_URL": self.database})


@pytest.fixture
def place(request: pytest.FixtureRequest, transactional_db: Any) -> Iterator[Place]:
    """`one host` (the default), or `two hosts` (parametrize indirectly)."""
    if getattr(request, "param", "one host") == "one host":
        yield Place(engines="127.0.0.1", redis=redis_url_or_skip())
        return
    with ExitStack() as stack:  # however the test ends: namespaces, links and the Redis go
        net = stack.enter_context(network("hostA", "hostB"))
        redis, database = stack.enter_context(redis_server(net.hub)), stack.enter_context(database_url(net.hub))
        yield Place(engines=net.hub, redis=redis, net=net, database=database)


@pytest.fixture
def engines(place: Place) -> Iterator[list[Engine]]:
    started = [start_engine(place.engines), start_engine(place.engines)]
    yield started
    for sim, _, _ in started:
        sim.stop()


@pytest.fixture
def gateways(place: Place) -> Iterator[Callable[..., tuple[Gateway, Gateway]]]:
    """`gateways(**env)` → two gateways on one Redis, with a key prefix of their own, reading the
    engines' load (to see the holder's outside queue)."""
    started: list[Gateway] = []

    def start(**env: str) -> tuple[Gateway, Gateway]:
        common = {
            "REDIS_URL": place.redis, "REDIS_KEY_PREFIX": f"test-kvgw-{secrets.token_hex(4)}:", "KV_EVENTS_SHARED_TTL_S": "120",
            "KV_EVENTS_CHECK_S": "0.1", "ENGINE_LOAD_POLL_S": "0.1", "ENGINE_LOAD_MAX_AGE_S": "1.0", **env,
        }  # fmt: skip
        for i in range(2):
            started.append(place.gateway(i, common).start())
        return started[-2], started[-1]

    yield start
    for gateway in started:
        gateway.stop()


def waiting(gateway: Gateway, sim: SimWorker) -> float | None:
    return kv(gateway, sim, "gateway_engine_requests_waiting")


def outside_queue(sim: SimWorker, n: int, *gateways: Gateway) -> None:
    """The engine reports `n` requests waiting from elsewhere; returns once every gateway routes on it."""
    sim.outside_load(n)
    for gateway in gateways:
        wait_until(lambda gateway=gateway: waiting(gateway, sim) == n, timeout=15, message=f"{gateway.url} never saw {n} waiting")


def first_turn(a: Gateway, b: Gateway, engines: list[Engine]) -> tuple[Any, list[dict[str, Any]], SimWorker, SimWorker]:
    """Turn 1 through A; then the holder reports an outside queue, seen by both. Returns the pool,
    turn 2's messages, the holder and the other engine."""
    cluster = register_pool([a, b], engines)
    sims = [sim for sim, _, _ in engines]
    for sim in sims:
        outside_queue(sim, 0, a, b)
    first = [{"role": "user", "content": "Refactor the parser. " + " ".join(f"w{i}" for i in range(200))}]
    answer = turn(a, cluster, first)
    holder, other = (sims[0], sims[1]) if received(sims[0]) == 1 else (sims[1], sims[0])
    assert (received(holder), received(other)) == (1, 0)
    wait_until(lambda: counter(a, LEARNED) == 1, timeout=15, message="A did not learn the first turn's token ids")
    outside_queue(holder, OUTSIDE_QUEUE, a, b)
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Now add tests."}]
    return cluster, second, holder, other


@pytest.mark.parametrize("place", ["one host", "two hosts"], indirect=True)
def test_a_turn_through_another_gateway_goes_to_the_engine_that_holds_its_prefix(
    gateways: Callable[..., tuple[Gateway, Gateway]], engines: list[Engine], place: Place
) -> None:
    a, b = gateways()
    cluster, second, holder, other = first_turn(a, b, engines)
    if place.net is not None:  # each gateway follows both engines' events over its own link
        for host in ("hostA", "hostB"):
            publishers = {(place.engines, int(pub.rsplit(":", 1)[1])) for _, pub, _ in engines}
            assert publishers <= place.net.peers(host), f"{host}'s connections: {place.net.peers(host)}"
    wait_until(lambda: counter(b, RECEIVED) == 1, timeout=15, message="B never received what A learned")
    turn(b, cluster, second)
    assert (received(holder), received(other)) == (2, 0)  # B: where the events say turn 1 is
    # B learned turn 2 in turn, and A keeps it: the processes know the same prompts.
    wait_until(lambda: counter(b, LEARNED) == 1 and counter(a, RECEIVED) == 1, timeout=15, message="A never received turn 2")

    # The holder's cache is reset, and the conversation's prompt lands on the other engine from
    # outside (traffic no gateway saw). Each gateway's own index still says the holder: A sent it
    # turn 1, B turn 2.
    outside_queue(holder, 0, a, b)
    sent = holder.requests()[-1]
    holder.kv_events(reset_prefix_cache=True)
    outside = httpx.post(other.url + "/v1/chat/completions", json={**sent, "stream": False}, timeout=30)
    assert outside.status_code == 200, outside.text
    for gateway in (a, b):
        wait_until(lambda gateway=gateway: kv(gateway, holder, "gateway_kv_events_blocks") == 0, timeout=15, message="no reset seen")
        wait_until(lambda gateway=gateway: (kv(gateway, other, "gateway_kv_events_blocks") or 0) > 0, timeout=15, message="not seen")
    third = [*second, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "And the docs."}]
    before = received(other)
    turn(a, cluster, third)
    turn(b, cluster, third)
    assert received(other) == before + 2 and received(holder) == 2  # neither prefers the holder now


def test_without_sharing_the_other_gateway_routes_on_its_own_index(
    gateways: Callable[..., tuple[Gateway, Gateway]], engines: list[Engine]
) -> None:
    """The control: the same turns with the learned prompts kept per process. B knows nothing of
    the conversation, and sends turn 2 to the idle engine (where it is prefilled again)."""
    a, b = gateways(KV_EVENTS_SHARED_TTL_S="0")
    cluster, second, holder, other = first_turn(a, b, engines)
    turn(b, cluster, second)
    assert (received(holder), received(other)) == (1, 1)
    assert counter(b, RECEIVED) == 0
