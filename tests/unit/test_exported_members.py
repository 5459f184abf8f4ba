"""Every `__all__` in the product packages (`disagg_project`, `messages_api`, `workers`, their
sub-packages and modules) lists its names once, sorted as httpx sorts its own (`str.casefold`),
and every name it lists resolves."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("disagg_project", "messages_api", "workers")


def declaring_all() -> list[str]:
    """The dotted names of the product modules that assign `__all__` at their top level."""
    found = []
    for package in PRODUCT_PACKAGES:
        for path in sorted((PROJECT_ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            if any(
                isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                for node in tree.body
            ):
                parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
                found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


MODULES = declaring_all()


def test_the_surfaces_are_found() -> None:
    assert {"disagg_project", "messages_api", "workers", "workers.protocols", "messages_api.limits"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_all_is_sorted_and_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported, key=str.casefold)
    assert len(set(exported)) == len(exported)
    for member in exported:
        assert hasattr(module, member), member
