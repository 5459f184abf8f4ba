"""Revoking an API key ends its requests in progress (messages_api/revocation.py): a stream under
way gets an `error` event (`authentication_error`) within the key cache's lifetime of the key
being deactivated or deleted, instead of running on to its deadline; its audit row says why; the
other keys' streams go on. Against a real daphne gateway and sim workers decoding slowly."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from messages_api.auth import CACHE_TTL_S, create_api_key, hash_key
from messages_api.models import ApiKey
from tests.support.cluster import Cluster, audit_row, register_cluster, wait_registered
from tests.support.gateway import Gateway
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker

pytestmark = pytest.mark.django_db(transaction=True)

# 400 tokens at 20 a second: a stream of 20 s, far longer than the revocation takes.
SLOW = {"tokens_per_second": 20}


def slow_stream(gateway: Gateway, cluster: Cluster, key: str) -> RawStream:
    payload = {
        "model": cluster.model, "max_tokens": 1000, "stream": True,
        "messages": [{"role": "user", "content": "go on [sim tokens=400]"}],
    }  # fmt: skip
    return RawStream.post_json(gateway.url + "/v1/messages", payload, {**cluster.headers(), "x-api-key": key})


@pytest.mark.parametrize("how", ["deactivated", "deleted"])
def test_revoking_a_key_ends_its_open_stream_with_an_error_event(
    transactional_db: Any, gateway: Gateway, sim_pair: Callable[..., tuple[SimWorker, SimWorker]], how: str
) -> None:
    cluster = register_cluster(*sim_pair("trtllm", **SLOW))
    wait_registered(gateway, cluster)
    _, other_key = create_api_key(f"bystander-{how}")

    revoked = slow_stream(gateway, cluster, cluster.key)
    bystander = slow_stream(gateway, cluster, other_key)
    for s in (revoked, bystander):
        assert s.read_head() == 200
        s.read_until("content_block_delta")

    api_key = ApiKey.objects.get(key_hash=hash_key(cluster.key))
    revoked_at = time.monotonic()
    if how == "deactivated":
        api_key.active = False
        api_key.save(update_fields=["active"])
    else:
        api_key.delete()

    frames = revoked.read_all(timeout=CACHE_TTL_S + 10)
    took = time.monotonic() - revoked_at
    events = [f.event for f in frames]
    assert events[-1] == "error", events[-5:]
    assert "message_stop" not in events
    assert events[-2] == "content_block_stop"  # the open text block closed first, as the SDKs expect
    error = frames[-1].data["error"]
    assert error["type"] == "authentication_error" and "revoked" in error["message"]
    # Within the key cache's lifetime (plus the machine's slack), not the stream's 20 s.
    assert took < CACHE_TTL_S + 3.0, took

    row = audit_row(revoked.response_headers["request-id"])
    assert row.status == "failed" and row.error_type == "authentication_error" and "revoked" in row.error_message
    assert row.http_status == 200  # the status line had gone out: the error is in the stream
    # The row names the key by its name then, and (while it exists) by the key's own row.
    assert row.api_key_name == api_key.name
    if how == "deactivated":
        assert row.api_key_id == api_key.pk

    # The other key's stream was left alone.
    assert bystander.read_until("content_block_delta", timeout=5)
    assert "error" not in bystander.events()
    bystander.close()

    # And the revoked key is refused from now on.
    again = slow_stream(gateway, cluster, cluster.key)
    assert again.read_head() == 401
    again.close()
