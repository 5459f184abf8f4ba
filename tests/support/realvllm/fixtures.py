"""The pytest fixture of the real engine, imported by each test module that needs it.

    from tests.support.realvllm.fixtures import engine  # noqa: F401 (a fixture)

Each importing module gets its own fixture definition, but they all hand out the process's one
server (`shared_server`), so the engine starts once per run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.realvllm.server import RealVllm, shared_server, stop_shared


@pytest.fixture(scope="session")
def engine() -> Iterator[RealVllm]:
    yield shared_server()
    stop_shared()
