"""What a run's workers tell the prefix index about their caches, and what a tenant is not told.

    feedback = CacheFeedback(pool.name)
    feedback.on_routed(placement)              # the generation endpoint, and the prompt's index key
    feedback.on_first_chunk(endpoint_id)       # it answered: it holds the prompt's prefix now
    feedback.on_prompt_tokens(ids)             # its first chunk's prompt_token_ids (KV events followed)
    if feedback.wants_usage and "usage" in chunk:
        feedback.on_usage(chunk["usage"])      # its first usage: did it still hold what was expected?
    feedback.on_failure(endpoint_id, error)    # the worker itself failed: its cache may be gone

The prefix index (`workers.routing.prefix_index`) is told where a prompt went by the router, and
learns the rest only here: a first answer confirms the endpoint holds the prefix, and evidence of
a lost cache (no cached token where the index expected some, or the worker failing outright)
starts the endpoint's marks over. Engine-reported KV-cache events (a cache cleared, a worker
restarted) are the next source of the same facts, and come in through the same methods.

`hide_cached_tokens` sits beside it because both read the worker's cached-token count, in an order
that matters: in a pool that keeps keys apart on an engine with no cache salt, the client is told
of no cache hit (it may be another key's), but only after `on_usage` has read the real count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workers.cluster.health import FailureScope, failure_scope
from workers.exceptions import WorkerError
from workers.kv_events.subscriber import kv_events
from workers.routing.prefix_index import get_index
from workers.routing.router import Placement


class CacheFeedback:
    """One run's feedback to this process's prefix index. Nothing happens until an event; with
    a pool that does not route by prefix (no index key) only a failed worker is forgotten."""

    __slots__ = ("_pool", "_placement", "_endpoint_id", "wants_usage")

    def __init__(self, pool: str) -> None:
        self._pool = pool
        self._placement: Placement | None = None
        self._endpoint_id = 0  # the generation endpoint
        #: No usage has been compared with the index yet: the relay's per-chunk test.
        self.wants_usage = True

    def on_routed(self, placement: Placement) -> None:
        """The generation endpoint is reserved; `placement.key` is the prompt as the index knows
        it (None: the pool does not route by prefix)."""
        self._placement = placement
        self._endpoint_id = placement.reservation.endpoint.id

    def on_first_chunk(self, endpoint_id: int) -> None:
        """The endpoint answered the prompt (the generation's first chunk, or a context worker's
        whole answer): it holds the prompt's prefix now."""
        placement = self._placement
        if placement is not None and placement.key is not None:
            get_index().confirm(endpoint_id, placement.key)

    def on_prompt_tokens(self, token_ids: list[int] | Callable[[], list[int]]) -> None:
        """The generation worker's first chunk carried the prompt's token ids (asked for when its
        engine's KV-cache events are followed), or the context answer did (a reader of them, run
        off the loop): the conversation's next turn is scored by the blocks of this prompt on the
        generation endpoint (`KvEvents.learn`, hashed off the loop)."""
        placement = self._placement
        if placement is not None and placement.key is not None:
            kv_events.learn(self._endpoint_id, placement.key.marks[-1], token_ids)

    def on_usage(self, usage: Any) -> None:
        """The generation worker's first usage report (called once). A worker that read no cached
        token of a prompt the index expected it to hold has lost its cache (a restart the health
        probe missed): its marks start over, with this prompt."""
        self.wants_usage = False
        placement = self._placement
        if placement is None or placement.key is None or not placement.matched_bytes:
            return
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached == 0:
            index = get_index()
            index.forget(self._endpoint_id)
            index.record(self._endpoint_id, self._pool, placement.key)
            index.confirm(self._endpoint_id, placement.key)

    def on_failure(self, endpoint_id: int, error: WorkerError) -> None:
        """A worker request failed. If the worker itself did (gone, reset, timed out), it may come
        back with an empty prefix cache: what the index says it holds is forgotten."""
        if failure_scope(error) is FailureScope.ENDPOINT:
            get_index().forget(endpoint_id)


def hide_cached_tokens(chunk: dict[str, Any]) -> None:
    """Report no prompt token as read from the worker's cache: in a pool that keeps keys apart on
    an engine without a cache salt, the hit may have been earned by another key's prompt."""
    usage = chunk.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict) and details.get("cached_tokens"):
        details["cached_tokens"] = 0


__all__ = ["CacheFeedback", "hide_cached_tokens"]
