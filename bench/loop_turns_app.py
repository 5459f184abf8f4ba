"""Loaded by a daphne that `bench/loop_turns.py` starts, as its ASGI application: wraps the real one
($LOOP_TURNS_APP) and counts, per request, the event loop's turns from the request's arrival
(daphne's `WebRequest.process`) to its first body bytes (Twisted's `Request.write`). SIGUSR2 writes
the counts so far to $LOOP_TURNS_OUT and starts afresh. A gateway started any other way never
loads it."""

from __future__ import annotations

import asyncio.base_events
import importlib
import json
import os
import signal
from typing import Any

import daphne.http_protocol
from twisted.web import http

turns = 0
samples: list[int] = []

_run_once = asyncio.base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]
_process = daphne.http_protocol.WebRequest.process
_write = http.Request.write


def _counted_run_once(self: Any) -> None:
    global turns
    turns += 1
    _run_once(self)


def _process_noting_the_turn(self: Any) -> Any:
    self._arrival_turn = turns
    return _process(self)


def _write_noting_the_turn(self: Any, data: bytes) -> None:
    arrival = getattr(self, "_arrival_turn", None)
    if arrival is not None and data:
        samples.append(turns - arrival)
        self._arrival_turn = None
    _write(self, data)


def _dump(_signum: int, _frame: object) -> None:
    with open(os.environ["LOOP_TURNS_OUT"], "w") as f:
        json.dump(samples, f)
    samples.clear()


asyncio.base_events.BaseEventLoop._run_once = _counted_run_once  # type: ignore[attr-defined]
daphne.http_protocol.WebRequest.process = _process_noting_the_turn
http.Request.write = _write_noting_the_turn
signal.signal(signal.SIGUSR2, _dump)

_module, _, _name = os.environ["LOOP_TURNS_APP"].partition(":")
application = getattr(importlib.import_module(_module), _name)
