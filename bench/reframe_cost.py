"""Per-token cost of the reframer's hot path: `StreamReframer.feed` on a vLLM-shaped text chunk
with continuous usage, alone and with `encode_event` (moved here from tests/unit/messages_api/test_reframe.py, where
a timing loop slowed the suite and asserted nothing; the test keeps the correctness check).

    .venv/bin/python bench/reframe_cost.py            # 20,000 chunks, best of 5
    .venv/bin/python bench/reframe_cost.py --chunks 200000 --repeat 7

Budget: 10 µs per chunk. Measured on the dev box: ~0.5 µs for feed, ~0.9 µs with encoding.
Pure CPU in this process (no gateway, no database); writes bench/results/reframe_cost.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h  # noqa: E402  (puts the project on the path)

# The reframer reads no setting, but its package imports Django models: the test settings need
# no SECRET_KEY or database to be configured.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "disagg_project.test_settings")

BUDGET_US = 10.0


def text_chunk() -> dict[str, Any]:
    """A chat.completion.chunk as vLLM / TRT-LLM send it, with continuous usage."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "qwen3",
        "choices": [{"index": 0, "delta": {"content": " token"}, "logprobs": None, "finish_reason": None}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 5, "total_tokens": 1005},
    }


def measure(chunks: int) -> tuple[float, float]:
    """(feed µs/chunk, feed+encode µs/chunk)."""
    from messages_api.framing import encode_event
    from messages_api.reframe import StreamReframer

    reframer = StreamReframer(message_id="msg_bench", model="claude-sonnet-4-6")
    chunk = text_chunk()
    reframer.feed(chunk)  # opens the block: every later chunk is the steady state
    t0 = time.perf_counter()
    for _ in range(chunks):
        reframer.feed(chunk)
    t1 = time.perf_counter()
    for _ in range(chunks):
        for event in reframer.feed(chunk):
            encode_event(event)
    t2 = time.perf_counter()
    return (t1 - t0) / chunks * 1e6, (t2 - t1) / chunks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5, help="runs; the best is reported (least disturbed)")
    args = parser.parse_args()
    import django

    django.setup()
    runs = [measure(args.chunks) for _ in range(args.repeat)]
    feed = min(r[0] for r in runs)
    both = min(r[1] for r in runs)
    h.print_table(
        f"reframer hot path, {args.chunks} chunks, best of {args.repeat}",
        ["path", "µs/chunk", "budget"],
        [["feed", feed, BUDGET_US], ["feed + encode_event", both, BUDGET_US]],
    )
    print(f"verdict: {h.verdict(both <= BUDGET_US)}")
    h.write_result(
        "reframe_cost", {"chunks": args.chunks, "repeat": args.repeat, "feed_us": feed, "feed_encode_us": both, "runs": runs, "budget_us": BUDGET_US}
    )


if __name__ == "__main__":
    main()
