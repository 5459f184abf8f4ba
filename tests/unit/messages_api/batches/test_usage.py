"""A Message Batch item's tokens count in its key's usage, and apart as the hour's batch part
(messages_api/usage.py)."""

from __future__ import annotations

from typing import Any

from messages_api.audit import AuditRecord
from messages_api.models import ApiKey, KeyUsage
from messages_api.usage import UsageRecorder


def test_batch_items_count_apart_within_the_keys_usage(transactional_db: Any) -> None:
    # transactional: a flush returns its connection to the pool on PostgreSQL (usage.py), which
    # an enclosing test transaction would not survive.
    key = ApiKey.objects.create(name="batcher", key_hash="h" * 64, prefix="sk-x")
    recorder = UsageRecorder(0)
    interactive = AuditRecord(api_key_id=key.pk, api_key_name=key.name, input_tokens=10, output_tokens=5)
    item = AuditRecord(
        api_key_id=key.pk, api_key_name=key.name, input_tokens=7, cache_creation_input_tokens=1, output_tokens=3,
        batch_id="msgbatch_x", custom_id="a", received_at=interactive.received_at,
    )
    recorder.note(interactive)
    recorder.note(item)
    assert recorder.flush()
    row = KeyUsage.objects.get(api_key=key)
    assert (row.requests, row.input_tokens, row.output_tokens) == (2, 18, 8)
    assert (row.batch_requests, row.batch_input_tokens, row.batch_output_tokens) == (1, 8, 3)
    recorder.note(item)
    assert recorder.flush()
    row.refresh_from_db()
    assert (row.requests, row.batch_requests, row.batch_input_tokens) == (3, 2, 16)
