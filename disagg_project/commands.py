"""What the management commands of both apps share: `limit_argument`, the argument type of a
limit, and `log_change`, which logs what a command changed (logger `gateway.changes`, INFO).

Changes made in the admin are in its history (Django's LogEntry: who, when, which fields), which
needs a user; a command run from a shell has none, so each command that changes keys, limits,
pools, endpoints or routes logs one line naming the command, the account that ran it (and the
one it came from through sudo) and what changed, old and new values, never a secret (a signing
key is "set" or "cleared"). The line goes where the process logs: the terminal, or the journal
of a `systemd-run` or a service (docs/security.md).
"""

from __future__ import annotations

import getpass
import logging
import os
from typing import Any

changes = logging.getLogger("gateway.changes")


def operator() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    sudo = os.environ.get("SUDO_USER")
    return f"{user} (sudo from {sudo})" if sudo and sudo != user else user


def log_change(command: str, message: str, *args: Any) -> None:
    """One line: `<command> by <account>: <message % args>`."""
    changes.info("%s by %s: " + message, command, operator(), *args)


def limit_argument(value: str) -> int:
    """A limit on the command line: a whole number, where 0 or `none` means no limit (given as 0)."""
    number = 0 if value.strip().lower() == "none" else int(value)
    if number < 0:
        raise ValueError(value)
    return number

