"""Serve the tiny model with the real vLLM server by hand, the way the tests start it.

    .venv/bin/python -m tests.support.realvllm.serve        # prints the URL; Ctrl-C stops it
"""

from __future__ import annotations

import signal
import threading

from tests.support.realvllm.server import RealVllm, missing


def main() -> None:
    reason = missing()
    if reason is not None:
        raise SystemExit(reason)
    server = RealVllm(name="serve").start()
    print(f"{server.url} serves {server.model} (started in {server.startup_seconds:.0f} s; log {server.log_path})", flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
