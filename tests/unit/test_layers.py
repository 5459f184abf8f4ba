"""Where things start and which way imports point: `workers` never imports `messages_api`; each
product package reaches another only through the names it declares public; and the background
services start once per process, not per request."""

from __future__ import annotations

import ast
import asyncio
import importlib
from pathlib import Path
from typing import Any

import pytest

from workers.cluster import services
from workers.cluster.registry import Registry

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("disagg_project", "messages_api", "workers")
# The places Django itself looks for in every app: another package may import these modules.
DJANGO_PLACES = ("models", "urls")


def imports_of(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) for every import in a file: names empty for `import x.y`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, tuple(alias.name for alias in node.names)))
    return found


def imported_modules(path: Path) -> set[str]:
    return {module for module, _ in imports_of(path)}


def crossing_violations(package: str, root: Path = PROJECT_ROOT) -> list[str]:
    """Imports, in `package` (under `root`), of another product package's names that it does not
    declare public (its `__all__`) or of its modules other than Django's places."""
    violations = []
    for path in sorted((root / package).rglob("*.py")):
        for module, names in imports_of(path):
            top, _, rest = module.partition(".")
            if top == package or top not in PRODUCT_PACKAGES:
                continue
            if rest in DJANGO_PLACES:
                continue
            public = set(importlib.import_module(top).__all__)
            if rest or not names or not set(names) <= public:
                shown = f"from {module} import {', '.join(names)}" if names else f"import {module}"
                violations.append(f"{path.relative_to(root)}: {shown}")
    return violations


@pytest.mark.parametrize("package", PRODUCT_PACKAGES)
def test_packages_meet_only_through_declared_surfaces(package: str) -> None:
    assert crossing_violations(package) == []


def test_the_check_sees_a_reach_past_the_surface(tmp_path: Path) -> None:
    """The rule is live: an import of an internal module, or of an undeclared name, is caught."""
    (tmp_path / "messages_api").mkdir()
    (tmp_path / "messages_api" / "_layers_probe.py").write_text(
        "from workers.routing.router import reserve\nfrom workers import Registry\nfrom workers import ChatRun\nfrom workers.models import WorkerPool\n"
    )
    assert crossing_violations("messages_api", root=tmp_path) == [
        "messages_api/_layers_probe.py: from workers.routing.router import reserve",
        "messages_api/_layers_probe.py: from workers import Registry",
    ]


@pytest.mark.parametrize("package", ["messages_api", "workers"])
def test_every_declared_name_resolves(package: str) -> None:
    """`__all__` is not a promise the lazy loader cannot keep."""
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(module._HOMES)
    for name in module.__all__:
        assert getattr(module, name) is not None, name


WORKERS = PROJECT_ROOT / "workers"


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
    monkeypatch.setattr(services, "start_services", lambda: started.append(asyncio.get_running_loop()))
    registry = Registry()
    await asyncio.gather(registry.snapshot(), registry.snapshot())
    await registry.snapshot()
    await registry.refresh()
    assert started == [asyncio.get_running_loop()]
