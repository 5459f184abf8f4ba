#!/usr/bin/env python
"""What following the engines' KV-cache events costs (workers/kv_events/).

    .venv/bin/python bench/kv_events_cost.py

Off the request path, on the subscriptions' thread: decoding a published batch and applying it to
an endpoint's index, per stored block (with the hash check, and without: an endpoint whose
algorithm is not set) and per removed block; hashing a learned prompt (the join), per block and
for a 20k-token prompt. On the request path: scoring one endpoint for a conversation with a known
prefix (`KvEvents.known_prefix` + `EndpointBlocks.leading`). Memory: an index of one million
blocks (tracemalloc). In-process timings, best of 5; writes bench/results/kv_events_cost.json.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "disagg_project.test_settings")

import django  # noqa: E402

django.setup()

from workers.kv_events.decode import BlockRemoved, BlockStored, decode_batch, encode_batch  # noqa: E402
from workers.kv_events.hashing import BlockHasher  # noqa: E402
from workers.kv_events.index import EndpointBlocks  # noqa: E402
from workers.kv_events.subscriber import KvEvents  # noqa: E402
from workers.routing.prefix_index import Prompt  # noqa: E402
from workers.schedule.rendered_chat import RenderedChat  # noqa: E402

BLOCK = 16
PER_BATCH = 16  # blocks per BlockStored (one request's new blocks in a step)


def best(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def stored_batches(hasher: BlockHasher, n: int) -> list[bytes]:
    rng = random.Random(1)
    payloads = []
    for _ in range(n):
        tokens = [rng.randrange(150000) for _ in range(BLOCK * PER_BATCH)]
        keys = hasher.keys(tokens, BLOCK)
        payloads.append(encode_batch(0.0, [BlockStored(tuple(keys), None, tuple(tokens), BLOCK, (None,) * PER_BATCH, "GPU")]))
    return payloads


def main() -> None:
    results: dict[str, Any] = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    rng = random.Random(2)
    tokens = [rng.randrange(150000) for _ in range(20000)]
    for algorithm in ("sha256", "sha256_cbor"):
        hasher = BlockHasher(algorithm)
        payloads = stored_batches(hasher, 200)
        blocks_total = 200 * PER_BATCH

        def apply(check: bool, payloads: list[bytes] = payloads, hasher: BlockHasher = hasher) -> None:
            index = EndpointBlocks(1, hasher if check else None, BLOCK)
            index.joined()
            for seq, payload in enumerate(payloads):
                index.on_live(seq, decode_batch(payload), 0.0)

        results[f"stored_checked_{algorithm}_us_per_block"] = best(lambda: apply(True)) / blocks_total * 1e6
        if algorithm == "sha256":
            results["stored_unchecked_us_per_block"] = best(lambda: apply(False)) / blocks_total * 1e6
            keys = [k for p in payloads for e in decode_batch(p).events if isinstance(e, BlockStored) for k in e.block_hashes]
            removals = [encode_batch(0.0, [BlockRemoved(tuple(keys[i : i + PER_BATCH]), "GPU")]) for i in range(0, len(keys), PER_BATCH)]
            removed = []
            for _ in range(5):
                index = EndpointBlocks(1, None, BLOCK)
                index.joined()
                for seq, payload in enumerate(payloads):
                    index.on_live(seq, decode_batch(payload), 0.0)
                started = time.perf_counter()
                for seq, payload in enumerate(removals):
                    index.on_live(len(payloads) + seq, decode_batch(payload), 0.0)
                removed.append(time.perf_counter() - started)
                assert index.size == 0
            results["removed_us_per_block"] = min(removed) / blocks_total * 1e6
        results[f"learn_20k_token_prompt_{algorithm}_ms"] = best(lambda h=hasher, t=tokens: h.keys(t, BLOCK)) * 1e3

    # Scoring one endpoint for a conversation whose earlier 20k-token prompt was learned.
    events = KvEvents()
    profile = ("sha256", "", BLOCK)
    chat = {"messages": [{"role": "user", "content": "x" * 2000}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]}
    prompt = Prompt(RenderedChat(chat), 2048)
    first = Prompt(RenderedChat({"messages": chat["messages"][:1]}), 2048)
    events._learn(profile, first.key.marks[-1], tokens)
    index = EndpointBlocks(1, None, BLOCK)
    index.profile = profile
    learned = events.known_prefix(index, prompt)
    assert learned is not None
    for key in learned[1][:900]:
        index._blocks[key] = -1
    n = 20000
    score = best(lambda: [index.leading(k[1]) for _ in range(n) if (k := events.known_prefix(index, prompt))])
    results["score_one_endpoint_us"] = score / n * 1e6

    # Memory of an index of one million blocks (random 64-bit keys, as engines publish).
    tracemalloc.start()
    big = EndpointBlocks(1, None, BLOCK, max_blocks=2_000_000)
    rng = random.Random(3)
    parent = -1
    for _ in range(1_000_000):
        key = rng.getrandbits(64)
        big._blocks[key] = parent
        parent = key
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    results["index_mb_per_million_blocks"] = current / 1e6
    for key, value in results.items():
        print(f"{key:45} {value:.2f}" if isinstance(value, float) else f"{key:45} {value}")
    out = ROOT / "bench" / "results" / "kv_events_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
