"""What the engines say they hold: their KV-cache events, followed per endpoint.

    decode.py      the published batches, both layouts, as plain values (pure)
    hashing.py     block hashes as vLLM computes them (sha256 of pickle, sha256_cbor); the gateway's own by tokens
    index.py       one endpoint's blocks and the seq / replay / reset state machine (pure)
    subscriber.py  the ZeroMQ subscriptions, on a thread of their own; `kv_events`
    shared.py      the prompts learned by each gateway process, shared through a Redis stream

Routing reads `kv_events.trusted(endpoint_id)`: the endpoint's `EndpointBlocks` while its events
are trusted, else None (it is then routed on the approximate prefix index,
`workers.routing.prefix_index`). docs/engines.md says how to start each engine so the gateway can
follow it.
"""

from __future__ import annotations

from workers.kv_events.decode import AllBlocksCleared, BadEvents, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from workers.kv_events.hashing import ALGORITHMS, TOKENS, BlockHasher, TokenKeys
from workers.kv_events.index import EndpointBlocks, Fallback, Replay
from workers.kv_events.subscriber import EventSource, KvEvents, kv_events

__all__ = [
    "ALGORITHMS", "AllBlocksCleared", "BadEvents", "BlockHasher", "BlockRemoved", "BlockStored", "decode_batch", "encode_batch",
    "EndpointBlocks", "EventBatch", "EventSource", "Fallback", "kv_events", "KvEvents", "Replay", "TokenKeys", "TOKENS",
]
