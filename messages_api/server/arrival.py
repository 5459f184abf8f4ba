"""When the server received a request: under a burst, well before the request's consumer runs.

The stream start wait (`MESSAGES_STREAM_START_WAIT_S`) is a promise to the client, so it counts
from when the request reached the server, not from when the event loop got round to it. With a
thousand requests arriving together, the last one's consumer starts ~100 ms after daphne parsed
it (bench/stream_start.py); counted from the consumer, that request's status line would leave
that much later than promised.

Daphne stamps each HTTP request when it has parsed it (`WebRequest.request_start`, wall-clock
seconds; it uses it for its access log) and hands the application a `send` bound to that request
object. `tests/unit/messages_api/server/test_arrival.py` checks this against daphne's own `Server.create_application`, so
an upgrade that changes it fails there (the names are listed in disagg_project/relied_on.py); any
other server falls back to "now".
"""

from __future__ import annotations

import functools
import time
from typing import Any

# A stamp further back than this is not trusted (a clock step, or a keep-alive connection's
# stale attribute): the request counts as received now.
MAX_PLAUSIBLE_LAG_S = 30.0


def seconds_since_received(send: Any) -> float:
    """How long ago the server received the request that `send` answers (0.0 if unknown)."""
    if not isinstance(send, functools.partial) or not send.args:
        return 0.0
    received = getattr(send.args[0], "request_start", None)
    if not isinstance(received, float):
        return 0.0
    lag = time.time() - received
    return lag if 0.0 < lag < MAX_PLAUSIBLE_LAG_S else 0.0
