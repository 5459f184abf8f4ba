"""`drop_tracebacks`: an answered error lets go of its frames, through its whole chain."""

from __future__ import annotations

import gc
import weakref

from disagg_project import drop_tracebacks


class Body:
    """Stands for a request's parsed body, kept alive by a frame's locals."""


def fail_with(body: Body) -> None:
    try:
        raise KeyError("inner")
    except KeyError as inner:
        raise ExceptionGroup("outer", [ValueError("member")]) from inner


def caught() -> tuple[BaseException, weakref.ref[Body]]:
    body = Body()
    try:
        fail_with(body)
    except BaseException as exc:  # noqa: BLE001 - the test wants it whatever it is
        exc.__context__ = exc  # a chain that loops must not loop the walk
        return exc, weakref.ref(body)
    raise AssertionError("fail_with did not raise")


def test_the_chain_loses_its_tracebacks_and_the_frames_their_locals() -> None:
    gc.disable()
    try:
        error, body = caught()
        assert body() is not None  # the traceback's frame keeps it
        drop_tracebacks(error)
        assert error.__traceback__ is None and error.__cause__ is not None and error.__cause__.__traceback__ is None
        assert body() is None  # freed by reference counting, the collector off
        assert error.__cause__.args == ("inner",) and str(error) == "outer (1 sub-exception)"  # the errors themselves stay
    finally:
        gc.enable()
