"""Where things start and which way imports point: `workers` never imports `messages_api`, and the
background services start once per process, not per request."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import pytest

from workers.cluster import services
from workers.cluster.registry import Registry

WORKERS = Path(__file__).resolve().parents[2] / "workers"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_workers_never_imports_the_front_door() -> None:
    offenders = {
        str(path.relative_to(WORKERS.parent)): sorted(m for m in imported_modules(path) if m.split(".")[0] == "messages_api")
        for path in WORKERS.rglob("*.py")
    }
    assert {path: found for path, found in offenders.items() if found} == {}


@pytest.mark.django_db(transaction=True)
async def test_the_registrys_first_load_starts_the_services_once(transactional_db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback for ASGI servers other than daphne (which starts them with its loop)."""
    started: list[asyncio.AbstractEventLoop] = []
    monkeypatch.setattr(services, "ensure_started", lambda: started.append(asyncio.get_running_loop()))
    registry = Registry()
    await asyncio.gather(registry.snapshot(), registry.snapshot())
    await registry.snapshot()
    await registry.refresh()
    assert started == [asyncio.get_running_loop()]
