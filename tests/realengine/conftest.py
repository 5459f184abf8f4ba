"""The real engine as a fixture for every module here.

It hands out the process's one server (`shared_server`), so the engine starts once per run and
stops when the session ends.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.realvllm.server import RealVllm, shared_server, stop_shared


@pytest.fixture(scope="session")
def engine() -> Iterator[RealVllm]:
    yield shared_server()
    stop_shared()
