"""daphne's own command line, on a uvloop event loop: `python -m disagg_project.daphne [daphne options] disagg_project.asgi:application`.

Why a launcher: daphne creates its event loop with `asyncio.new_event_loop()` and installs
Twisted's asyncio reactor on it when `daphne.server` is first imported, before it loads the
application. So the loop's kind must be chosen before that import, and the application module
(disagg_project.asgi) comes too late. This module sets uvloop's event loop policy, then runs
daphne's command line unchanged (every daphne option works as with `daphne`).

Why uvloop: with one token per worker read and one frame per client write (a real engine's pace),
the gateway's CPU goes mostly to the event loop's own work per token: waking on the worker's
socket, the reader callback, the task wake-up, the transport's recv. uvloop does that work in C
(measured in bench/README.md, "uvloop under daphne"). Twisted's asyncio reactor needs only the
loop's public API (add_reader/add_writer, call_at, call_soon_threadsafe, run_forever), which
uvloop implements.

`GATEWAY_UVLOOP=0` keeps asyncio's own loop (read from the environment: Django's settings are not
loaded yet). `manage.py serve` starts its processes through this module; so do the benchmarks
and the tests' gateway. `disagg_project.asgi` exports the loop's kind as the metric
`gateway_event_loop_info`.
"""

from __future__ import annotations

import asyncio
import os

ENV_FLAG = "GATEWAY_UVLOOP"


def uvloop_wanted() -> bool:
    """On unless the environment says otherwise (the settings' `env_bool` convention: unset or
    empty is the default, 1/true/yes/on is on, anything else off)."""
    value = os.environ.get(ENV_FLAG)
    if value is None or value == "":
        return True
    return value.strip().lower() in {"1", "true", "yes", "on"}


def use_uvloop() -> bool:
    """Make asyncio's new loops uvloop's, if wanted; returns whether it did. Must run before
    `daphne.server` is imported."""
    if not uvloop_wanted():
        return False
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def main() -> None:
    use_uvloop()
    from daphne.cli import CommandLineInterface

    CommandLineInterface.entrypoint()


if __name__ == "__main__":
    main()
