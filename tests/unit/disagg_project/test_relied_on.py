"""disagg_project/relied_on.py: every third-party internal the gateway relies on still exists, the
source copied from Channels is unchanged, and the installed packages are the versions the list was
checked against; each check is shown to see what it is for."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

from disagg_project.relied_on import (
    PINNED_SOURCES,
    RELIANCES,
    PinnedSource,
    Reliance,
    installed_version,
    missing,
)

PROJECT_ROOT = Path(__file__).resolve().parents[3]
REGISTRY = "disagg_project/relied_on.py"


def version_mismatches(entries: Iterable[Reliance | PinnedSource]) -> list[str]:
    """One line per package whose installed version is not the one its entries were checked
    against, followed by those entries."""
    stale: dict[tuple[str, str], list[str]] = {}
    for entry in entries:
        installed = installed_version(entry.package)
        if installed != entry.version:
            names = f".{'/'.join(entry.names)}" if isinstance(entry, Reliance) else " (pinned source)"
            stale.setdefault((entry.package, installed), []).append(
                f"  {entry.owner}{names} [checked against {entry.version}], used by {entry.used_by}"
                f"\n      why: {entry.why}"
            )
    return [
        f"{package} {installed} is installed; re-check:\n" + "\n".join(lines)
        for (package, installed), lines in stale.items()
    ]


def test_every_relied_on_name_still_exists() -> None:
    gone = missing()
    assert not gone, (
        "third-party internals the gateway relies on are gone or changed (see "
        f"{REGISTRY}); adapt the module that uses each:\n" + "\n".join(gone)
    )


def test_the_installed_versions_are_the_ones_checked() -> None:
    stale = version_mismatches([*RELIANCES, *PINNED_SOURCES])
    if stale:
        pytest.fail(
            f"installed versions differ from those {REGISTRY} was checked against. Re-check each "
            "reliance listed against the new version's source (does the name still mean what `why` "
            "says?), then update its `checked_against`:\n" + "\n".join(stale),
            pytrace=False,
        )


def test_missing_reports_what_is_gone() -> None:
    """The check is live: a name, an owner, a module that do not exist, and a pin that does not
    match, are each reported; names that exist (instance attributes included) are not."""
    reliances = [
        Reliance(
            "twisted.web.http.HTTPChannel", ("dataReceived", "_handlingRequest", "noSuchName"),
            "here", "probe", "Twisted 0",
        ),
        Reliance("twisted.web.http.NoSuchClass", ("x",), "here", "probe", "Twisted 0"),
        Reliance("no_such_package.module", ("x",), "here", "probe", "nothing 0"),
    ]
    pins = [
        PinnedSource("channels.consumer.AsyncConsumer.__call__", "0" * 64, "here", "probe", "channels 0"),
        PinnedSource("channels.consumer.AsyncConsumer.no_such_method", "0" * 64, "here", "probe", "channels 0"),
    ]
    gone = missing(reliances, pins)
    assert [line.split(":")[0] for line in gone] == [
        "twisted.web.http.HTTPChannel.noSuchName",
        "twisted.web.http.NoSuchClass",
        "no_such_package.module",
        "channels.consumer.AsyncConsumer.__call__",
        "channels.consumer.AsyncConsumer.no_such_method",
    ]
    assert "source changed" in gone[3]


def test_an_instance_attribute_counts_only_where_its_class_sets_it() -> None:
    # `_asyncioEventloop` is set in AsyncioSelectorReactor.__init__, and by no HTTPChannel method.
    reactor = Reliance("twisted.internet.asyncioreactor.AsyncioSelectorReactor", ("_asyncioEventloop",), "", "", "")
    channel = Reliance("twisted.web.http.HTTPChannel", ("_asyncioEventloop",), "", "", "")
    assert missing([reactor], []) == []
    assert len(missing([channel], [])) == 1


def test_the_version_check_sees_a_different_version() -> None:
    entry = Reliance("twisted.web.http.HTTPChannel", ("dataReceived",), "here", "probe", "Twisted 0.0")
    [stale] = version_mismatches([entry])
    assert stale.startswith(f"Twisted {installed_version('Twisted')} is installed")
    assert "twisted.web.http.HTTPChannel.dataReceived [checked against 0.0], used by here\n      why: probe" in stale


def test_every_user_named_is_a_module_of_the_project() -> None:
    entries: list[Reliance | PinnedSource] = [*RELIANCES, *PINNED_SOURCES]
    for entry in entries:
        path = entry.used_by.split(" (")[0]
        assert (PROJECT_ROOT / path).is_file(), f"{entry.owner}: {path} does not exist"


def test_the_registry_imports_no_product_module() -> None:
    """It names owners by dotted string and imports only third-party and standard modules, so any
    package may read it without an import cycle."""
    tree = ast.parse((PROJECT_ROOT / REGISTRY).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] in ("messages_api", "workers", "disagg_project")}
