"""Sampling a process with py-spy while a benchmark runs, and a summary of where it spent its time."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .paths import PROJECT_ROOT, PYTHON, RESULTS_DIR


class Profiler:
    """`py-spy record` on one process, collapsed stacks, and a top-functions summary."""

    def __init__(self, pid: int, name: str, rate: int = int(os.environ.get("BENCH_PROFILE_RATE", "250"))) -> None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        self.path = RESULTS_DIR / f"{name}.txt"
        spy = Path(PYTHON).parent / "py-spy"
        exe = str(spy) if spy.exists() else shutil.which("py-spy")
        if exe is None:
            raise RuntimeError("py-spy is not installed: .venv/bin/pip install py-spy")
        self.process = subprocess.Popen(
            [exe, "record", "-p", str(pid), "-r", str(rate), "-f", "raw", "-o", str(self.path), "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)

    def stop(self, top: int = 25) -> None:
        if self.process.poll() is None:
            self.process.send_signal(2)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        summarize_profile(self.path, top)


@contextlib.contextmanager
def profiled(pids: Sequence[int], name: str, enabled: bool) -> Iterator[None]:
    """Profile the processes `pids` (names `<name>-<i>`) for the duration of the block, if enabled."""
    profilers = [Profiler(pid, name if len(pids) == 1 else f"{name}-{i}") for i, pid in enumerate(pids)] if enabled else []
    try:
        yield
    finally:
        for profiler in profilers:
            profiler.stop()


def summarize_profile(path: Path, top: int = 25) -> None:
    """Self and inclusive sample shares per function from py-spy's collapsed (raw) output."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        print(f"(no profile at {path})")
        return
    total = 0
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    for line in lines:
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")" if " (" in f else f
                  for f in stack.split(";")]
        # Idle threads (the event loop in select/epoll, executor threads waiting) are not work.
        leaf = frames[-1]
        if any(k in leaf for k in ("select (", "poll (", "wait (", "_worker (", "get (queue")):
            continue
        total += count
        own[leaf] = own.get(leaf, 0) + count
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + count
    if not total:
        print("(empty profile)")
        return
    print(f"\nprofile: {total} busy samples ({path.relative_to(PROJECT_ROOT)})")
    print("  self %   function")
    for name, count in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * count / total:6.1f}   {name}")
    print("  incl %   function")
    for name, count in sorted(inclusive.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * count / total:6.1f}   {name}")
