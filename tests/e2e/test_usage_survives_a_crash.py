"""A gateway process killed with SIGKILL loses none of the usage its audit rows show: a request's
usage is written in the transaction of its terminal row, and the rows the recovery sweep closes
for the dead process are counted as it closes them. After the kill and the sweep, the usage per
key and hour is the sum over the key's audit rows.

(Before, usage went to the database every USAGE_FLUSH_INTERVAL_S on a thread of its own: a kill
lost the last interval's usage while its audit rows were kept, 60 of 60 requests in the probe.)
"""

from __future__ import annotations

import signal
from collections import Counter
from typing import Any

import httpx
import pytest

from messages_api.models import KeyUsage, MessageRequest
from messages_api.usage import hour_of
from tests.support.cluster import audit_row, register_cluster, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker

pytestmark = pytest.mark.django_db(transaction=True)

# A sweep that finds the dead process within a second. USAGE_FLUSH_INTERVAL_S is retired (a warning
# if set): before, it kept usage in memory past the kill.
SETTINGS = {"USAGE_FLUSH_INTERVAL_S": "3600", "GATEWAY_HEARTBEAT_INTERVAL_S": "0.2", "GATEWAY_DEAD_AFTER_S": "1"}
COMPLETED = 24
IN_FLIGHT = 2


def usage_of(key_id: int) -> dict[int, tuple[int, int, int, int, dict[str, int]]]:
    """The key's usage rows: hour → (requests, input, output, cache read, errors)."""
    return {
        hour_of(u.hour): (u.requests, u.input_tokens, u.output_tokens, u.cache_read_tokens, dict(u.errors))
        for u in KeyUsage.objects.filter(api_key_id=key_id)
    }


def sum_of_rows(key_id: int) -> dict[int, tuple[int, int, int, int, dict[str, int]]]:
    """The same figures summed over the key's terminal audit rows, as usage counts them."""
    sums: dict[int, list[Any]] = {}
    for row in MessageRequest.objects.filter(api_key_id=key_id).exclude(status="in_progress"):
        total = sums.setdefault(hour_of(row.received_at), [0, 0, 0, 0, Counter()])
        total[0] += 1
        total[1] += (row.input_tokens or 0) + (row.cache_creation_input_tokens or 0)
        total[2] += row.output_tokens or 0
        total[3] += row.cache_read_input_tokens or 0
        if row.error_type:
            total[4][row.error_type] += 1
    return {hour: (r, i, o, c, dict(errors)) for hour, (r, i, o, c, errors) in sums.items()}


def test_usage_after_a_sigkill_is_the_sum_of_the_audit_rows(context_worker: SimWorker, generation_worker: SimWorker) -> None:
    first = Gateway(SETTINGS).start()
    try:
        cluster = register_cluster(context_worker, generation_worker)
        wait_registered(first, cluster)
        request_ids = []
        with httpx.Client(timeout=30) as client:
            for i in range(COMPLETED):
                response = client.post(
                    first.url + "/v1/messages",
                    json={"model": cluster.model, "max_tokens": 16, "messages": [{"role": "user", "content": f"hi {i} [sim tokens={1 + i % 5}]"}]},
                    headers=cluster.headers(),
                )
                assert response.status_code == 200, response.text[:300]
                request_ids.append(response.headers["request-id"])
        # Streams still going when the process dies: their rows are in the database, in progress.
        streams = [
            RawStream.post_json(
                first.url + "/v1/messages",
                {"model": cluster.model, "max_tokens": 4000, "stream": True, "messages": [{"role": "user", "content": "long [sim tokens=100000]"}]},
                cluster.headers(),
            )
            for _ in range(IN_FLIGHT)
        ]
        for stream in streams:
            stream.read_until("content_block_delta")
        in_flight = [stream.response_headers["request-id"] for stream in streams]
        # The rows reached the database (the row writer's window, 0.25 s, is what a kill can lose).
        rows = [audit_row(request_id) for request_id in request_ids]
        assert {row.status for row in rows} == {"completed"}
        wait_until(
            lambda: MessageRequest.objects.filter(request_id__in=in_flight).count() == len(in_flight), message="the in-flight streams' rows"
        )
        key_id = rows[0].api_key_id
        assert key_id is not None
        first.kill(signal.SIGKILL)
    finally:
        first.stop()

    # A live process sweeps the dead one's rows (the next start; or another of the suite's gateways,
    # which share the database and sweep too).
    with Gateway(SETTINGS):
        for request_id in in_flight:
            row = audit_row(request_id, timeout=20)
            assert row.status == "failed" and "died" in row.error_message
        expected = sum_of_rows(key_id)
        assert sum(hour[0] for hour in expected.values()) == COMPLETED + IN_FLIGHT
        assert sum(hour[4].get("api_error", 0) for hour in expected.values()) == IN_FLIGHT
        assert sum(hour[2] for hour in expected.values()) >= COMPLETED
        wait_until(lambda: usage_of(key_id) == expected, timeout=10,
                   message=f"usage {usage_of(key_id)} against the audit rows' {expected}")  # fmt: skip
