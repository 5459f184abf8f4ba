#!/usr/bin/env python
"""What routing on engine-reported load costs (workers/cluster/engine_load.py, router._load).

    .venv/bin/python bench/engine_load_cpu.py

Per request, on the event loop: `router._load` (called a few times per candidate per routing
decision) and a whole `least_loaded` decision over 2 and 8 candidates, with polling off (the view
empty), with fresh figures for every endpoint, and with stale ones. Per poll, off the loop: reading
one engine's scrape (`WorkerProtocol.read_load`) for a typical vLLM scrape (~100 KB, mostly
histograms) and for a hostile one at the size limit (2 MiB, every line a wanted metric). In-process
timings (time.perf_counter over many calls, best of 5); writes bench/results/engine_load_cpu.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "disagg_project.settings")

import django  # noqa: E402

django.setup()

from workers.cluster.engine_load import _entry, engine_loads  # noqa: E402
from workers.cluster.registry import EndpointInfo, PoolInfo  # noqa: E402
from workers.protocols import PROTOCOLS  # noqa: E402
from workers.protocols.engine_load import EngineLoad  # noqa: E402
from workers.routing import router  # noqa: E402

VLLM_HEAD = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4375
"""


def best(fn: Callable[[], object], n: int) -> float:
    """Best of 5 runs of n calls: seconds per call."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - start) / n)
    return min(runs)


def pool(n: int) -> PoolInfo:
    endpoints = tuple(
        EndpointInfo(id=900_000 + i, pool_name="bench", role="generation", url=f"http://e{i}", enabled=True, draining=False, healthy=True)
        for i in range(n)
    )
    return PoolInfo(id=1, name="bench", model="m", schedule_style="aggregated", max_local_prefill_tokens=0, routing="least_loaded",
                    protocol="vllm", created_at=datetime.now(timezone.utc), endpoints=endpoints)  # fmt: skip


def routing(state: str) -> dict[str, Any]:
    engine_loads.view.clear()
    result: dict[str, Any] = {}
    for n in (2, 8):
        p = pool(n)
        if state != "off":
            read_at = time.time() - (3600 if state == "stale" else 0)
            for i, endpoint in enumerate(p.endpoints):
                engine_loads.view[endpoint.id] = _entry(EngineLoad(waiting=i, running=1, kv_usage=0.95), read_at, polled_here=True)
        candidates = list(p.endpoints)
        result[f"load_ns_{n}"] = best(lambda c=candidates: router._load(c[0]), 200_000) * 1e9
        result[f"decision_us_{n}"] = best(lambda p=p, c=candidates: router._least_loaded(p, "generation", c, None), 20_000) * 1e6
    engine_loads.view.clear()
    return result


def parsing() -> dict[str, Any]:
    reader = PROTOCOLS["vllm"]
    typical = VLLM_HEAD + "".join(f'vllm:request_latency_seconds_bucket{{engine="0",le="{i}",model_name="m"}} {i}.0\n' for i in range(1200))
    hostile = "".join(f'vllm:num_requests_waiting{{engine="{i}"}} 1\n' for i in range(60_000))[: 2 * 1024 * 1024]
    return {
        "typical_bytes": len(typical),
        "typical_us": best(lambda: reader.read_load(typical, "m"), 200) * 1e6,
        "hostile_bytes": len(hostile),
        "hostile_ms": best(lambda: reader.read_load(hostile, "m"), 5) * 1e3,
    }


def main() -> None:
    result = {state: routing(state) for state in ("off", "fresh", "stale")}
    result["parse"] = parsing()
    print(json.dumps(result, indent=2))
    out = ROOT / "bench" / "results" / "engine_load_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
