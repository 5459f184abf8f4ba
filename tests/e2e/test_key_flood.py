"""A tenant cannot hurt the gateway with keys: against real daphne processes on real sockets, keys the
gateway did not issue (random `sk-gw-` keys, malformed ones, the issued form with a wrong tag) are
refused 401 at the headers without a query of the API key table, keys of both forms work, a valid
key keeps working beside a flood, failures per address are throttled (429 with retry-after), and
lookups beyond their concurrency wait, then get 529.

The queries are the gateway process's own: tests/support/query_log/sitecustomize.py (on its
PYTHONPATH) appends every statement any of its database connections runs to a file, which the
tests read."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.gateway import PROJECT_ROOT, Gateway

pytestmark = pytest.mark.django_db(transaction=True)

QUERY_LOG_DIR = PROJECT_ROOT / "tests" / "support" / "query_log"
KEY_TABLE = "messages_api_apikey"


class QueryLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[str]:
        try:
            return self.path.read_text().splitlines()
        except FileNotFoundError:
            return []

    def key_queries(self, since: int = 0) -> list[str]:
        return [line for line in self.lines()[since:] if KEY_TABLE in line]


@pytest.fixture(scope="module")
def counted(
    django_db_setup: Any, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., tuple[Gateway, QueryLog]]]:
    """`counted(**env)`: a gateway whose queries are logged, with a legacy key made before it starts."""
    running: list[Gateway] = []

    def start(**env: str) -> tuple[Gateway, QueryLog]:
        log = QueryLog(tmp_path_factory.mktemp("queries") / "queries.log")
        path = os.pathsep.join(p for p in (str(QUERY_LOG_DIR), os.environ.get("PYTHONPATH", "")) if p)
        with django_db_blocker.unblock():
            gateway = Gateway({"PYTHONPATH": path, "GATEWAY_QUERY_LOG": str(log.path), **env}).start()
        running.append(gateway)
        return gateway, log

    yield start
    for gateway in running:
        gateway.stop()


def models(gateway: Gateway, key: str | None, **headers: str) -> httpx.Response:
    sent = {"anthropic-version": "2023-06-01", **headers}
    if key is not None:
        sent["x-api-key"] = key
    return httpx.get(gateway.url + "/v1/models", headers=sent, timeout=30)


def legacy_key(name: str) -> str:
    """A key as they were issued before they carried a tag, stored as they were."""
    from messages_api.auth import hash_key
    from messages_api.models import ApiKey

    key = "sk-gw-" + secrets.token_urlsafe(32)
    ApiKey.objects.create(name=name, key_hash=hash_key(key), prefix=key[:12])
    return key


def not_issued(i: int) -> list[tuple[str, str]]:
    """(header, value) pairs of credentials the gateway did not issue."""
    from messages_api import key_format

    random_part = "".join(secrets.choice(key_format.ALPHABET) for _ in range(key_format.RANDOM_LENGTH + key_format.TAG_LENGTH))
    return [
        ("x-api-key", "sk-gw-" + secrets.token_urlsafe(32)),  # the old form, random (the flood of the finding)
        ("authorization", "Bearer sk-gw-" + secrets.token_urlsafe(32)),
        ("x-api-key", key_format.KEY_PREFIX + random_part),  # the issued form, a random tag
        ("x-api-key", f"not-a-key-{i}"),
        ("x-api-key", "sk-ant-api03-" + secrets.token_urlsafe(60)),
        ("x-api-key", secrets.token_hex(i % 40 + 1)),
    ]


def test_keys_not_issued_are_refused_at_the_headers_without_a_query(counted: Callable[..., tuple[Gateway, QueryLog]]) -> None:
    from messages_api.auth import create_api_key, generate_key

    old = legacy_key(f"legacy-{time.monotonic_ns()}")
    gateway, log = counted(GATEWAY_LEGACY_KEYS_REFRESH_S="3600")
    # Both forms work: the old one through the legacy keys' set (loaded once, by its first use).
    assert models(gateway, old).status_code == 200
    _, new = create_api_key(f"new-{time.monotonic_ns()}")
    assert new.startswith("sk-gw2-")
    assert models(gateway, new).status_code == 200
    # The log sees lookups: a key of the issued form that is in no database is looked up once.
    mark = len(log.lines())
    unknown = generate_key()
    for _ in range(3):
        assert models(gateway, unknown).status_code == 401
    # (Only its own: the valid keys' `last_used_at` writes land whenever the writer gets to them.)
    from messages_api.auth import hash_key

    looked_up = [q for q in log.key_queries(mark) if hash_key(unknown) in q]
    assert len(looked_up) == 1, log.key_queries(mark)

    mark = len(log.lines())
    statuses: Counter[int] = Counter()
    for i in range(100):
        for header, value in not_issued(i):
            response = httpx.get(gateway.url + "/v1/models", headers={header: value, "anthropic-version": "2023-06-01"}, timeout=30)
            statuses[response.status_code] += 1
            assert response.json()["error"] == {"type": "authentication_error", "message": "invalid x-api-key"}
    assert statuses == {401: 600}
    assert log.key_queries(mark) == []
    # Refused at the headers: a request that declares a body it never sends is answered at once.
    head = (
        f"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\nx-api-key: sk-gw-{secrets.token_urlsafe(32)}\r\n"
        "content-length: 30000000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(head.encode("ascii"))
        assert sock.recv(100).startswith(b"HTTP/1.1 401 ")
    assert log.key_queries(mark) == []


def test_a_valid_key_keeps_working_beside_a_flood(counted: Callable[..., tuple[Gateway, QueryLog]]) -> None:
    from messages_api.auth import create_api_key, hash_key

    gateway, log = counted(GATEWAY_LEGACY_KEYS_REFRESH_S="3600")
    _, key = create_api_key(f"beside-{time.monotonic_ns()}")
    assert models(gateway, key).status_code == 200
    assert models(gateway, "sk-gw-" + secrets.token_urlsafe(32)).status_code == 401  # loads the legacy set: one query
    mark = len(log.lines())
    stop = threading.Event()
    flood: Counter[int] = Counter()

    def flooding() -> None:
        with httpx.Client(timeout=30) as client:
            i = 0
            while not stop.is_set():
                header, value = not_issued(i)[i % 6]
                flood[client.get(gateway.url + "/v1/models", headers={header: value}).status_code] += 1
                i += 1

    threads = [threading.Thread(target=flooding) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        while sum(flood.values()) < 50:
            time.sleep(0.01)
        timings = []
        for _ in range(30):
            started = time.monotonic()
            assert models(gateway, key).status_code == 200
            timings.append(time.monotonic() - started)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert set(flood) == {401} and sum(flood.values()) >= 50
    assert max(timings) < 5.0  # a loaded shared machine; bench/key_flood.py measures the latency
    digest = hash_key(key)
    # The flood made no query of the key table; the valid key's own refreshes are all there is.
    assert [q for q in log.key_queries(mark) if digest not in q] == []


def test_failures_per_address_are_throttled_and_a_known_valid_key_goes_on(counted: Callable[..., tuple[Gateway, QueryLog]]) -> None:
    from messages_api.auth import create_api_key

    gateway, log = counted(GATEWAY_AUTH_FAILURES_PER_MINUTE="6")  # 6 at once, then one each 10 s
    _, key = create_api_key(f"throttled-{time.monotonic_ns()}")
    assert models(gateway, key).status_code == 200  # known valid from now on
    for i in range(6):
        assert models(gateway, "sk-gw-" + secrets.token_urlsafe(32)).status_code == 401, i
    refused = models(gateway, "sk-gw-" + secrets.token_urlsafe(32))
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 10
    assert refused.headers["request-id"] == refused.json()["request_id"]
    # Every credential from the address but a key known valid: no key, a new valid key (not looked
    # up for a throttled address), a forwarded header (not believed without TRUSTED_PROXIES).
    assert models(gateway, None).status_code == 429
    _, fresh = create_api_key(f"fresh-{time.monotonic_ns()}")
    mark = len(log.lines())
    assert models(gateway, fresh).status_code == 429
    assert log.key_queries(mark) == []
    assert models(gateway, "sk-gw-" + secrets.token_urlsafe(32), **{"x-forwarded-for": "198.51.100.7"}).status_code == 429
    for _ in range(5):
        assert models(gateway, key).status_code == 200
    # After retry-after, one more failure is allowed (refusals did not extend the wait), then 429.
    deadline = time.monotonic() + 20
    while (status := models(gateway, "sk-gw-" + secrets.token_urlsafe(32)).status_code) == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 401
    assert models(gateway, "sk-gw-" + secrets.token_urlsafe(32)).status_code == 429
    assert models(gateway, fresh).status_code == 429


def test_lookups_past_their_concurrency_wait_then_get_529(counted: Callable[..., tuple[Gateway, QueryLog]]) -> None:
    """One lookup at a time, each taking 1 s (the database under load); a request that waits
    0.2 s for its turn is answered 529 overloaded_error at the headers."""
    from messages_api.auth import generate_key

    gateway, log = counted(GATEWAY_KEY_LOOKUP_CONCURRENCY="1", GATEWAY_KEY_LOOKUP_WAIT_S="0.2", GATEWAY_QUERY_DELAY_S="1")
    keys = [generate_key() for _ in range(4)]  # each its own lookup
    with ThreadPoolExecutor(len(keys)) as pool:
        answers = list(pool.map(lambda k: models(gateway, k), keys))
    statuses = Counter(a.status_code for a in answers)
    assert statuses[529] >= 1 and set(statuses) <= {401, 529}, statuses
    for answer in answers:
        if answer.status_code == 529:
            assert answer.json()["error"]["type"] == "overloaded_error"
            assert answer.headers["retry-after"] == "1"
    assert len(log.key_queries()) <= len(keys) - statuses[529] + 1  # the refused ones never queried
