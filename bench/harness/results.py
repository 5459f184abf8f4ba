"""The JSON result file each benchmark writes to bench/results/, with the machine it ran on."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from .paths import PROJECT_ROOT, RESULTS_DIR


def machine_info() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg_at_start": os.getloadavg(),
    }


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    data = {"benchmark": name, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(), **data}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\nresult written to {path.relative_to(PROJECT_ROOT)}")
    return path


def in_ms(d: dict[str, float]) -> dict[str, float]:
    """A distribution of seconds as milliseconds (for JSON output)."""
    return {k: (v * 1000 if k != "n" else v) for k, v in d.items()}
