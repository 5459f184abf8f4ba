"""Open-file limits for this process and the children it starts."""

from __future__ import annotations

import resource


def raise_nofile(want: int = 65536) -> int:
    """Raise this process's open-files soft limit (children inherit it); returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def child_setup() -> None:
    # Runs in each child before exec: as many open files as the hard limit allows.
    raise_nofile()
