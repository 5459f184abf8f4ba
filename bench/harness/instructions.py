"""Instructions a gateway executes, counted by valgrind's callgrind rather than timed.

On a shared VM the CPU time of the same work drifts by a quarter or more within one run (the
host's other tenants), so a few per cent between two commits is out of a timed A/B's reach. An
instruction count is the same whatever else the machine is doing: the gateway runs under
`valgrind --tool=callgrind` with counting off, and `callgrind_control` switches it on around the
measured requests only. Every thread counts (the log writer's and the row writer's work too); the
kernel's part of a system call does not. Under valgrind the gateway runs 20-50 times slower, so
figures from it are instructions, never times.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

__all__ = ["CallgrindCounter", "callgrind_command", "callgrind_available"]

# `callgrind_control -e Ir` prints "Totals: Ir" and then a line per thread: "Th 1  27,664,800".
_THREAD_TOTAL = re.compile(r"^\s*Th\s+\d+\s+([\d,]+)", re.MULTILINE)


def callgrind_available() -> bool:
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def callgrind_command(out_dir: Path) -> list[str]:
    """The prefix that starts a process under callgrind with counting off (`CallgrindCounter`
    turns it on)."""
    return [
        # --quiet: valgrind's banner stays out of the gateway's log. The profile is written at the
        # process's exit to `out_dir` (a Stack's directory: `--keep` keeps it for callgrind_annotate).
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_dir}/callgrind.out.%p", "--quiet",
    ]


class CallgrindCounter:
    """Instructions executed by one process under `callgrind_command`, between `start` and `stop`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def _control(self, *args: str) -> str:
        result = subprocess.run(["callgrind_control", *args, str(self.pid)], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"callgrind_control {' '.join(args)} failed: {result.stderr or result.stdout}")
        return result.stdout

    def start(self) -> None:
        self._control("--instr=on")
        self._control("--zero")

    def stop(self) -> list[int]:
        """The instructions counted since `start`, per thread in the order the threads started
        (the first is the main thread: daphne's event loop); counting off. (Counts can only be
        read while counting is on.)"""
        printed = self._control("-e", "Ir")
        threads = _THREAD_TOTAL.findall(printed)
        self._control("--instr=off")
        if not threads:
            raise RuntimeError(f"callgrind_control printed no totals:\n{printed}")
        return [int(count.replace(",", "")) for count in threads]
