#!/usr/bin/env python
"""What following the engines' KV-cache events costs (workers/kv_events/).

    .venv/bin/python bench/kv_events_cost.py

Off the request path, on the subscriptions' thread: decoding a published batch and applying it to
an endpoint's index, per stored block (with the hash check, and without: an endpoint whose
algorithm is not set) and per removed block; hashing a learned prompt (the join), per block and
for a 20k-token prompt. On the request path: scoring one endpoint for a conversation with a known
prefix (`KvEvents.known_prefix` + `EndpointBlocks.leading`). Memory: an index of one million
blocks (tracemalloc). In-process timings, best of 5.

With a Redis at TEST_REDIS_URL (default redis://127.0.0.1:6379/0), the learned prompts shared
between gateway processes (workers/kv_events/shared.py), a 20k-token prompt (1,250 blocks) per
entry: the CPU of publishing one (its thread's), of following the stream per entry received
(another thread, as another process's), and the time from publishing to kept elsewhere
(entries 5 ms apart; p50 / p99 / max). Writes bench/results/kv_events_cost.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import threading
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
from workers.kv_events.shared import SharedPrompts  # noqa: E402
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
    results |= shared_costs(array_of(BlockHasher("sha256").keys(tokens, BLOCK)))
    for key, value in results.items():
        print(f"{key:45} {value:.2f}" if isinstance(value, float) else f"{key:45} {value}")
    out = ROOT / "bench" / "results" / "kv_events_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


def array_of(keys: list[int]) -> Any:
    from array import array

    return array("Q", keys)


def shared_costs(keys: Any, paced: int = 300, burst: int = 2000) -> dict[str, Any]:
    """Publishing learned prompts to the shared stream and following it, on two threads (as two
    processes would: each with its own loop and connections)."""
    from django.conf import settings

    from tests.support.redis import REDIS_URL as url
    from tests.support.redis import redis_answers

    if not redis_answers(url):
        print(f"no Redis at {url}: the shared stream is not measured")
        return {}
    settings.REDIS_URL, settings.REDIS_KEY_PREFIX = url, f"bench-kvshared-{os.getpid()}-{time.monotonic_ns()}:"
    settings.KV_EVENTS_SHARED_TTL_S, settings.KV_EVENTS_SHARED_ENTRIES = 120.0, 10 * burst
    profile = ("sha256", "", BLOCK)
    kept_at: dict[int, float] = {}
    kept_cpu: dict[int, float] = {}
    all_kept = threading.Event()

    def keep(_profile: Any, mark: int, _keys: Any) -> None:
        kept_at[mark] = time.perf_counter()
        kept_cpu[mark] = time.thread_time()
        if len(kept_at) == paced + burst:
            all_kept.set()

    def follow() -> None:
        async def main() -> None:
            follower = SharedPrompts(keep, instance="reader")
            task = asyncio.get_running_loop().create_task(follower.follow())
            while not all_kept.is_set():
                await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await follower.aclose()

        asyncio.run(main())

    follower_thread = threading.Thread(target=follow)
    follower_thread.start()

    async def publish() -> dict[str, float]:
        publisher = SharedPrompts(keep, instance="writer")
        await asyncio.sleep(0.5)  # the follower is waiting on the stream
        sent_at = {}
        for mark in range(paced):
            sent_at[mark] = time.perf_counter()
            publisher.publish(profile, mark, keys)
            await asyncio.sleep(0.005)
        while len(kept_at) < paced:
            await asyncio.sleep(0.01)
        started = time.thread_time()
        for mark in range(paced, paced + burst):
            publisher.publish(profile, mark, keys)
            if mark % 64 == 0:
                await asyncio.sleep(0)  # as learned prompts come, a few per turn of the loop at most
        await publisher._state.drain()
        cpu = time.thread_time() - started
        await publisher.aclose()
        latencies = sorted(kept_at[m] - sent_at[m] for m in range(paced))
        return {
            "shared_publish_us_per_prompt": cpu / burst * 1e6,
            "shared_latency_ms_p50": statistics.median(latencies) * 1e3,
            "shared_latency_ms_p99": latencies[int(0.99 * len(latencies))] * 1e3,
            "shared_latency_ms_max": latencies[-1] * 1e3,
        }

    measured = asyncio.run(publish())
    all_kept.wait(60)
    follower_thread.join()
    first, last = paced, paced + burst - 1
    measured["shared_follow_us_per_prompt"] = (kept_cpu[last] - kept_cpu[first]) / (burst - 1) * 1e6
    measured["shared_blocks_per_prompt"] = len(keys)
    return measured


if __name__ == "__main__":
    main()
