"""CPU, memory and page-fault figures of processes and of the machine, from /proc, and a meter
of the CPU some processes use between two points."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Mapping, Sequence

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy (not idle or iowait), from /proc/stat."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    return (sum(fields[:8]) - idle) / CLK_TCK


def wait_for_quiet(max_wait: float, busy_below: float = 0.15, hold: float = 3.0) -> str:
    """Wait (up to `max_wait` s) until the whole machine has been under `busy_below` of its cores
    for `hold` seconds: other sessions' test suites share these 2 cores. Returns a note."""
    if max_wait <= 0:
        return "did not wait for a quiet machine"
    cores = os.cpu_count() or 1
    start = time.monotonic()
    quiet_since: float | None = None
    last = machine_busy_seconds()
    while time.monotonic() - start < max_wait:
        time.sleep(0.5)
        now = machine_busy_seconds()
        busy = (now - last) / (0.5 * cores)
        last = now
        if busy < busy_below:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= hold:
                return f"machine quiet after {time.monotonic() - start:.0f} s"
        else:
            quiet_since = None
    note = f"machine still busy after waiting {max_wait:.0f} s (other processes): figures are pessimistic"
    print(f"warning: {note}", file=sys.stderr)
    return note


def proc_sys_cpu_seconds(pid: int) -> float:
    """The system (kernel) part of `proc_cpu_seconds`: system calls, and on loopback the
    receiving side's TCP processing that a send runs."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[12]) / CLK_TCK


def proc_minor_faults(pid: int) -> int:
    """Minor page faults of a process (all its threads) so far: on this VM ~3.5 µs each, and a
    glibc heap trim per request shows as dozens of them."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[7])


def thread_cpu_seconds(pid: int, tid: int | None = None) -> float:
    """CPU seconds of one thread (the main thread, where the event loop runs, by default)."""
    tid = pid if tid is None else tid
    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) in KiB from /proc/<pid>/status."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith((b"VmRSS:", b"VmHWM:")):
                key, value = line.split(b":", 1)
                out[key.decode()] = int(value.split()[0])
    return out


def rss_mib(pid: int) -> float:
    return proc_memory_kib(pid).get("VmRSS", 0) / 1024


def hwm_mib(pid: int) -> float:
    return proc_memory_kib(pid).get("VmHWM", 0) / 1024


def self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """CPU seconds used by some processes (and this one) between `start()` and `stop()`."""

    def __init__(self, pids: Mapping[str, int | Sequence[int]]) -> None:
        # A name may stand for several processes (a gateway of N daphnes): their CPU is summed.
        self.pids: dict[str, tuple[int, ...]] = {
            name: (pid,) if isinstance(pid, int) else tuple(pid) for name, pid in pids.items()
        }
        self.begin: dict[str, float] = {}
        self.used: dict[str, float] = {}
        self.wall = 0.0

    def _read(self) -> dict[str, float]:
        out = {name: sum(map(proc_cpu_seconds, pids)) for name, pids in self.pids.items()}
        out["machine"] = machine_busy_seconds()
        for name, pids in self.pids.items():
            if name.startswith("gateway"):
                # The event loop's own thread; the rest is the audit writer and executor threads.
                out[f"{name}:loop-thread"] = sum(map(thread_cpu_seconds, pids))
            if name.startswith(("gateway", "router", "floor")):
                out[f"{name}:kernel"] = sum(map(proc_sys_cpu_seconds, pids))
        out["loadgen"] = self_cpu_seconds()
        return out

    def start(self) -> CpuMeter:
        self.begin = self._read()
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> dict[str, float]:
        self.wall = time.perf_counter() - self._t0
        now = self._read()
        self.used = {name: now[name] - self.begin[name] for name in now}
        ours = sum(v for k, v in self.used.items() if k != "machine" and ":" not in k)
        # CPU used by processes outside this benchmark (other sessions' tests, ...): a busy
        # machine makes every latency and throughput figure worse.
        self.used["others"] = max(self.used["machine"] - ours, 0.0)
        return self.used

    def machine_note(self) -> str:
        cores = os.cpu_count() or 1
        busy = self.used.get("machine", 0.0) / (self.wall * cores) * 100 if self.wall else 0.0
        others = self.used.get("others", 0.0) / self.wall if self.wall else 0.0
        return (f"machine: {busy:.0f}% of {cores} cores busy; processes outside this benchmark used "
                f"{others:.2f} cores on average")
