"""Shared pieces of the benchmark scripts, a module per concern:

    paths       the project (put on the import path), bench/results, the Python to run
    limits      open-file limits for this process and its children
    proc        /proc sampling: CPU, memory and faults per process and for the machine; CpuMeter
    processes   a benchmark's world: Stack (database, sim workers, gateways, routers, floors)
    options     the command-line options every script shares (--quick, --keep, --profile, ...)
    profiling   py-spy sampling of a process during a run, and its summary
    bodies      requests on the wire: Messages bodies, gateway and worker requests
    client      the load generator's lean raw HTTP/1.1 client
    stats       distributions and printed tables
    results     the JSON result file of a run

Everything here is plain Python (no pytest): each script creates its own SQLite database in a
temporary directory, runs `manage.py migrate`, starts simulated workers (`manage.py simworker`),
registers them, creates an API key and starts daphne on a socket it bound itself (`--fd`).

The scripts use the names below as `h.NAME` (`import harness as h`, with bench/ on the path, or
`from bench import harness as h`). Code shared with the tests lives in tests/support.
"""

from __future__ import annotations

from .paths import PROJECT_ROOT, PYTHON, RESULTS_DIR  # first: puts the project on the import path

# isort: split
from .bodies import ANTHROPIC_VERSION, MODEL, build_request, gateway_request, messages_body, port_of, worker_request
from .client import HttpConnection, KeepAlive, Response, connect
from .instructions import CallgrindCounter, callgrind_available, callgrind_command
from .limits import raise_nofile
from .options import add_common_arguments, parse_args, resolve, result_name
from .proc import (
    CpuMeter,
    hwm_mib,
    machine_busy_seconds,
    proc_cpu_seconds,
    proc_memory_kib,
    proc_minor_faults,
    proc_sys_cpu_seconds,
    rss_mib,
    self_cpu_seconds,
    thread_cpu_seconds,
    wait_for_quiet,
)
from .processes import (
    FLOORS,
    ROUTERS,
    GatewayProc,
    Proc,
    RouterProc,
    SimProc,
    Stack,
    http_get_json,
    sim_stats,
    start_sim_pair,
    wait_ready,
)
from .profiling import Profiler, profiled, summarize_profile
from .results import in_ms, machine_info, write_result
from .stats import DIST_HEADERS, dist_row, distribution, percentile, print_distributions, print_table, verdict

__all__ = [
    "ANTHROPIC_VERSION",
    "CallgrindCounter",
    "callgrind_available",
    "callgrind_command",
    "DIST_HEADERS",
    "FLOORS",
    "MODEL",
    "PROJECT_ROOT",
    "PYTHON",
    "RESULTS_DIR",
    "ROUTERS",
    "CpuMeter",
    "GatewayProc",
    "HttpConnection",
    "KeepAlive",
    "Proc",
    "Profiler",
    "Response",
    "RouterProc",
    "SimProc",
    "Stack",
    "add_common_arguments",
    "build_request",
    "connect",
    "dist_row",
    "distribution",
    "gateway_request",
    "http_get_json",
    "hwm_mib",
    "in_ms",
    "machine_busy_seconds",
    "machine_info",
    "messages_body",
    "parse_args",
    "percentile",
    "port_of",
    "print_distributions",
    "print_table",
    "proc_cpu_seconds",
    "proc_memory_kib",
    "proc_minor_faults",
    "proc_sys_cpu_seconds",
    "profiled",
    "raise_nofile",
    "resolve",
    "result_name",
    "rss_mib",
    "self_cpu_seconds",
    "sim_stats",
    "start_sim_pair",
    "summarize_profile",
    "thread_cpu_seconds",
    "verdict",
    "wait_for_quiet",
    "wait_ready",
    "worker_request",
    "write_result",
]
