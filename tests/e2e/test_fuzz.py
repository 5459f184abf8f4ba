"""Property-based fuzzing of a live gateway: whatever a client sends — random JSON in every field
of a valid request, wrong types, deep nesting, huge strings, invalid UTF-8, bad headers, unknown
paths under /v1/, wrong methods — the answer is below 500, in Anthropic's envelope (or a valid
message or stream), and complete before the client gives up.

The generators live in tests/support/hostile.py (bench/fuzz.py runs them 10,000 times). Bounded for CI:
MAX_EXAMPLES per test and no per-example deadline (the gateway, not hypothesis, is under test).
Issue 9's known offenders are explicit examples, tried first on every run; hypothesis keeps
failing examples in .hypothesis/ and replays them first next time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import hypothesis
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.support import hostile
from tests.support.cluster import Cluster, register_cluster, wait_registered
from tests.support.gateway import Gateway
from tests.support.simworkers import SimWorker

MAX_EXAMPLES = 150
CLIENT_TIMEOUT_S = 20.0
# A request whose body never fully arrives (a declared length larger than what is sent) is the
# gateway's to cut: well before the client's timeout.
GATEWAY_ENV = {"MESSAGES_BODY_READ_TIMEOUT_S": "3"}
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    # One gateway and one registered pool serve every example of a test: the fixtures are
    # function-scoped on purpose (the database is flushed after each test).
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    report_multiple_bugs=True,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fuzz_gateway(gateways: Callable[..., Gateway]) -> Gateway:
    return gateways(**GATEWAY_ENV)


@pytest.fixture
def fuzz_cluster(transactional_db: Any, fuzz_gateway: Gateway, context_worker: SimWorker, generation_worker: SimWorker) -> Cluster:
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(fuzz_gateway, cluster)
    return cluster


def check(gateway: Gateway, request: hostile.HostileRequest) -> None:
    url = urlsplit(gateway.url)
    assert url.hostname is not None and url.port is not None
    answer = hostile.send(url.hostname, url.port, request, CLIENT_TIMEOUT_S)
    category, detail = hostile.problem(request, answer)
    assert not category, f"{category}: {detail}\nrequest: {request.describe()}"


Known = Callable[[str, str], list[hostile.HostileRequest]]


def fuzz(strategy: Callable[[str, str], st.SearchStrategy[hostile.HostileRequest]], known: Known | None = None) -> Callable[[Gateway, Cluster], None]:
    """A test that checks `strategy`'s requests against the gateway, the `known` ones first."""

    def run(fuzz_gateway: Gateway, fuzz_cluster: Cluster) -> None:
        def example(request: hostile.HostileRequest) -> None:
            check(fuzz_gateway, request)

        for case in known(fuzz_cluster.key, fuzz_cluster.model) if known else []:
            example = hypothesis.example(case)(example)
        hypothesis.given(strategy(fuzz_cluster.key, fuzz_cluster.model))(FUZZ_SETTINGS(example))()

    return run


def _known_headers(key: str, model: str) -> list[hostile.HostileRequest]:
    return [r for r in hostile.known_other_cases(key, model) if r.kind.startswith("headers")]


def _known_paths(key: str, model: str) -> list[hostile.HostileRequest]:
    return [r for r in hostile.known_other_cases(key, model) if r.kind.startswith("path")]


test_hostile_json_in_every_field = fuzz(hostile.json_requests, hostile.known_json_cases)
test_hostile_bytes_as_the_body = fuzz(hostile.byte_requests)
test_hostile_headers = fuzz(hostile.header_requests, _known_headers)
test_unknown_paths_and_wrong_methods = fuzz(hostile.path_requests, _known_paths)


def test_the_judge_rejects_what_the_gateway_must_not_send() -> None:
    """The oracle itself: a 500, an HTML 404, a silent close and an unfinished stream are each
    caught (so a green fuzz run means something)."""
    request = hostile.HostileRequest("GET", "/v1/nothing", [], b"", "self-test")
    envelope = b'{"type":"error","error":{"type":"not_found_error","message":"no"}}'
    cases = {
        "5xx": hostile.Answer(status=500, body=envelope),
        "non_envelope": hostile.Answer(status=404, headers={"content-type": "text/html"}, body=b"<h1>Not Found</h1>"),
        "no_answer": hostile.Answer(),
        "hang": hostile.Answer(hung=True),
    }
    for category, answer in cases.items():
        assert hostile.problem(request, answer)[0] == category
    stream = hostile.Answer(
        status=200, headers={"content-type": "text/event-stream"}, body=b'event: message_start\ndata: {"type":"message_start"}\n\n'
    )
    assert hostile.problem(request, stream)[0] == "non_envelope"
    assert hostile.problem(request, hostile.Answer(status=404, body=envelope)) == ("", "")
