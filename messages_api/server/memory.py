"""Giving memory back after large requests (glibc only; a no-op elsewhere).

A 30 MB request body and what it parses to are freed when the request ends, but glibc keeps
freed heap memory for reuse, and raises its mmap threshold each time a large mmapped block is
freed (up to 32 MB), after which large blocks come from the heap too: a gateway that served a few
large requests stayed ~1 GB larger than before. Pinning the threshold makes every block above it
an mmap returned to the system on free; `trim()` after a large request returns what the heap
holds free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

logger = logging.getLogger(__name__)

# mallopt(3): M_MMAP_THRESHOLD; setting it also turns off its dynamic adjustment.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 256 * 1024

_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name or "libc.so.6")
            libc.malloc_trim  # noqa: B018 (glibc only)
            libc.mallopt  # noqa: B018
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


def install() -> None:
    libc = _glibc()
    if libc is not None and not libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        logger.warning("mallopt(M_MMAP_THRESHOLD) failed: large requests' memory may stay with the process")


def trim() -> None:
    """Return free heap memory to the system (a few ms: run it off the event loop). A collection
    first: a request's objects may still be held in a reference cycle (an exception's traceback
    and its frames), which only the collector frees."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
