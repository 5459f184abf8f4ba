"""What the Message Batches tests share: a gateway's batch settings and a batch item's shape."""

from __future__ import annotations

from typing import Any

# A gateway that runs a batch runner, with short intervals: the tests wait for conditions, never
# for fixed times.
BATCH_ENV = {
    "BATCH_RUNNER_ENABLED": "1",
    "BATCH_POLL_INTERVAL_S": "0.1",
    "BATCH_SWEEP_INTERVAL_S": "0.2",
    "BATCH_RETRY_BASE_S": "0.2",
    "BATCH_RETRY_MAX_S": "1",
    # Renewals every 4/3 s: a process notices an item it lost (its batch expired) within that,
    # whichever of a module's gateways claimed it.
    "BATCH_LEASE_S": "4",
}


def item(custom_id: str, text: str, model: str, **params: Any) -> dict[str, Any]:
    """One request of a batch: `text` as the user's message to `model`."""
    return {"custom_id": custom_id, "params": {"model": model, "max_tokens": 32, "messages": [{"role": "user", "content": text}], **params}}
