"""Where things start and which way imports point: `workers` never imports `messages_api`; the
shared layer (`disagg_project`'s public names) imports neither app; each product package reaches
another only through the names it declares public; and the background services start once per
process, not per request."""

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
        "from workers.routing.router import reserve\nfrom workers import Registry\n"
        "from workers import ChatRun\nfrom workers.models import WorkerPool\n"
    )
    assert crossing_violations("messages_api", root=tmp_path) == [
        "messages_api/_layers_probe.py: from workers.routing.router import reserve",
        "messages_api/_layers_probe.py: from workers import Registry",
    ]
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "_layers_probe.py").write_text(
        "from disagg_project.writer import get_writer\nfrom disagg_project import RowWriter\nfrom disagg_project import new_id\n"
    )
    assert crossing_violations("workers", root=tmp_path) == [
        "workers/_layers_probe.py: from disagg_project.writer import get_writer",
        "workers/_layers_probe.py: from disagg_project import RowWriter",
    ]


@pytest.mark.parametrize("package", PRODUCT_PACKAGES)
def test_every_declared_name_resolves(package: str) -> None:
    """`__all__` is not a promise the lazy loader cannot keep."""
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(module._HOMES)
    for name in module.__all__:
        assert getattr(module, name) is not None, name


WORKERS = PROJECT_ROOT / "workers"
APPS = ("messages_api", "workers")


def shared_layer_violations(root: Path = PROJECT_ROOT) -> list[str]:
    """Imports of either app by a module behind `disagg_project.__all__`, or by a project module
    it imports in turn (the wiring, asgi.py and urls.py, is not behind it and imports both)."""
    homes = importlib.import_module("disagg_project")._HOMES
    to_visit = sorted({module for module, _ in homes.values()})
    seen: set[str] = set()
    violations = []
    while to_visit:
        module = to_visit.pop()
        if module in seen:
            continue
        seen.add(module)
        path = root / (module.replace(".", "/") + ".py")
        for imported, names in imports_of(path):
            if imported.split(".")[0] in APPS:
                violations.append(f"{path.relative_to(root)}: {imported}")
            elif imported.startswith("disagg_project."):
                to_visit.append(imported)
            elif imported == "disagg_project":
                to_visit.extend(homes[name][0] if name in homes else f"disagg_project.{name}" for name in names)
    return violations


def test_the_shared_layer_imports_neither_app() -> None:
    """What both apps use cannot lean on either: `workers` would import `messages_api` through it,
    and either app's import would load the other."""
    assert shared_layer_violations() == []


def test_the_shared_layer_check_sees_an_app_import(tmp_path: Path) -> None:
    (tmp_path / "disagg_project").mkdir()
    for module, _ in importlib.import_module("disagg_project")._HOMES.values():
        (tmp_path / (module.replace(".", "/") + ".py")).write_text("")
    (tmp_path / "disagg_project" / "ids.py").write_text("from disagg_project.probe import x\n")
    (tmp_path / "disagg_project" / "probe.py").write_text("from workers import ChatRun\nimport messages_api.models\n")
    assert shared_layer_violations(root=tmp_path) == [
        "disagg_project/probe.py: workers",
        "disagg_project/probe.py: messages_api.models",
    ]


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
