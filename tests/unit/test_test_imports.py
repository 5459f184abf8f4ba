"""No module imports a test module: what tests share lives in tests/support/.

A test module imported by another brings its fixtures, `pytestmark` and module-level setup with it,
and moving or renaming it (the unit tests mirror the packages they test) breaks the importer. The
rule holds for the whole project, so bench/ takes its helpers from tests/support/ too. Imports are
read with `ast` (nothing is imported), absolute and relative alike."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def project_files(root: Path) -> Iterator[Path]:
    """Every Python file of the project: its top-level directories but hidden ones (.venv, .git)."""
    for top in sorted(root.iterdir()):
        if top.is_dir() and not top.name.startswith("."):
            yield from sorted(top.rglob("*.py"))


def module_file(root: Path, module: str) -> Path | None:
    """The project file a dotted module name is, if any."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def is_test_module(root: Path, path: Path) -> bool:
    """A module pytest collects or runs as a test module: tests/**/test_*.py or a conftest.py.
    (A product module may be named test_*: disagg_project/test_settings.py is settings.)"""
    relative = path.relative_to(root)
    return relative.parts[0] == "tests" and (path.name.startswith("test_") or path.name == "conftest.py")


def imported_names(root: Path, path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted module) for every module a file may import, relative imports resolved: for
    `from a import b`, both `a` and `a.b` (b may be a module)."""
    package = list(path.relative_to(root).parent.parts)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def imports_of_test_modules(root: Path = PROJECT_ROOT) -> list[str]:
    """"file:line imports module" for every import, anywhere in the project, of a test module."""
    found = []
    for path in project_files(root):
        for line, module in imported_names(root, path):
            target = module_file(root, module) if module else None
            if target is not None and target != path and is_test_module(root, target):
                found.append(f"{path.relative_to(root)}:{line} imports {module}")
    return found


def test_no_module_imports_a_test_module() -> None:
    assert imports_of_test_modules() == [], "move what is shared into tests/support/"


def test_the_check_sees_every_form_of_import(tmp_path: Path) -> None:
    def write(relative: str, text: str = "") -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    for package in ("tests", "tests/e2e", "tests/unit", "tests/support", "bench", "app"):
        write(f"{package}/__init__.py")
    write("tests/e2e/test_shared.py", "def helper() -> None: ...\n")
    write("tests/conftest.py")
    write("tests/support/helpers.py", "def helper() -> None: ...\n")
    write("app/test_settings.py")  # a product module named test_*: importing it is fine
    write(
        "tests/e2e/test_user.py",
        "from tests.e2e.test_shared import helper\n"
        "import tests.e2e.test_shared\n"
        "from tests.e2e import test_shared\n"
        "from .test_shared import helper as again\n"
        "from . import test_shared as same\n"
        "from tests import conftest\n"
        "from tests.support.helpers import helper as fine\n"
        "from app import test_settings\n",
    )
    write("tests/unit/test_other.py", "from ..e2e.test_shared import helper\n")
    write("bench/run.py", "def main() -> None:\n    from tests.e2e.test_shared import helper\n")

    found = imports_of_test_modules(tmp_path)

    assert found == [
        "bench/run.py:2 imports tests.e2e.test_shared",
        "tests/e2e/test_user.py:1 imports tests.e2e.test_shared",
        "tests/e2e/test_user.py:2 imports tests.e2e.test_shared",
        "tests/e2e/test_user.py:3 imports tests.e2e.test_shared",
        "tests/e2e/test_user.py:4 imports tests.e2e.test_shared",
        "tests/e2e/test_user.py:5 imports tests.e2e.test_shared",
        "tests/e2e/test_user.py:6 imports tests.conftest",
        "tests/unit/test_other.py:1 imports tests.e2e.test_shared",
    ]
