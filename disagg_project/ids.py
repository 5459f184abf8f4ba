"""The identity of this gateway process in the rows it writes, and the ids it makes.

The next start-up closes the open rows of instances that are gone (see `workers.cluster.recovery`).
"""

import os
import random
import socket
import uuid

GATEWAY_INSTANCE = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

# Ids of requests, reservations and leases: unique, not secret. `uuid4` asks the kernel for
# randomness on every call (a getrandom syscall each, three or more per request); a generator
# seeded once from the kernel draws them in user space. Reseeded in a forked child, which would
# otherwise repeat its parent's ids.
_ids = random.Random(os.urandom(32))
_ids_pid = os.getpid()


def new_id() -> str:
    """128 random bits as 32 hex digits (uuid4's `.hex` form)."""
    global _ids, _ids_pid
    if os.getpid() != _ids_pid:
        _ids, _ids_pid = random.Random(os.urandom(32)), os.getpid()
    return f"{_ids.getrandbits(128):032x}"
