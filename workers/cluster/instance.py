"""The identity of this gateway process in the rows it writes.

The next start-up closes the open rows of instances that are gone (see `workers.cluster.recovery`).
"""

import os
import socket
import uuid

GATEWAY_INSTANCE = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
