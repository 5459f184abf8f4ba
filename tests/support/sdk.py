"""The official `anthropic` SDK as the tests call it: a client that never retries, and one message
asked for streamed (through the SDK's stream helper and its accumulation) or not.

    with sdk_client(gateway.url, cluster.key) as client:
        message = sdk_message(client, streamed, model=cluster.model, max_tokens=64, messages=[...])
"""

from __future__ import annotations

from typing import Any

import anthropic
from anthropic.types import Message


def sdk_client(base_url: str, key: str, *, timeout: float = 30.0, **options: Any) -> anthropic.Anthropic:
    """A client of `base_url` with `key` as its API key; no retries, so a test sees every answer."""
    return anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=timeout, **options)


def sdk_message(
    client: anthropic.Anthropic, stream: bool, *, events: list[Any] | None = None, **params: Any
) -> Message:
    """`client.messages.create(**params)`, or with `stream` the final message of
    `client.messages.stream(**params)`; the stream's events (the helper's, text and input_json
    included) are appended to `events` when it is given."""
    if not stream:
        created: Message = client.messages.create(**params)
        return created
    with client.messages.stream(**params) as streamed:
        if events is not None:
            events.extend(streamed)
        return streamed.get_final_message()
