"""Letting go of an answered error's frames.

An exception keeps its traceback, the traceback keeps every frame it passed through, and each
frame keeps its locals: for a request, its body parsed (a Claude Code request is tens of thousands
of objects), its run, its consumer. The frames usually refer back to the exception (a
`Completion` that stored it, a consumer that recorded it), so the whole request is a reference
cycle that only the garbage collector's full pass frees. Under a flood of refused requests those
cycles made most of the heap: full collections of 60–120 ms each, every few seconds, stalled every
stream on the event loop (bench/tenants.py, docs/tenancy.md).

Once the error is answered and logged, nothing reads its traceback again: dropping it (and its
chained causes') frees the request by reference counting, at once.
"""

from __future__ import annotations

__all__ = ["drop_tracebacks"]


def drop_tracebacks(exc: BaseException) -> None:
    """Drop the traceback of `exc` and of every exception chained to it (cause and context)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending.append(current.__cause__)
        pending.append(current.__context__)
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
