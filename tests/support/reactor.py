"""A stand-in for Twisted's reactor under a real transport: it records what the transport asks of
it (writer registrations, delayed calls) instead of polling, so a test drives the socket itself."""

from __future__ import annotations

from typing import Any


class RecordingReactor:
    """Records writer registrations (a set, as the real reactor's) and delayed calls."""

    def __init__(self) -> None:
        self.writers: list[Any] = []
        self.later: list[tuple[Any, tuple[Any, ...]]] = []

    def addWriter(self, selectable: Any) -> None:
        if selectable not in self.writers:
            self.writers.append(selectable)

    def removeWriter(self, selectable: Any) -> None:
        if selectable in self.writers:
            self.writers.remove(selectable)

    def addReader(self, selectable: Any) -> None:
        pass

    def removeReader(self, selectable: Any) -> None:
        pass

    def callLater(self, delay: float, f: Any, *args: Any) -> None:
        self.later.append((f, args))
