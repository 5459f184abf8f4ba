"""Files with secrets are created unreadable to others, whatever the caller's umask: the SQLite
database a gateway process creates (sessions, password hashes, signing keys) and `make run`'s
secret-key file, which must be 0600 from the moment it exists (not 0644 until a chmod)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from tests.support.gateway import PROJECT_ROOT


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def loose_umask() -> None:
    os.umask(0o022)  # a usual login shell's


def test_migrate_creates_the_sqlite_database_0600(tmp_path: Path) -> None:
    database = tmp_path / "gateway.sqlite3"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "disagg_project.settings",
        "DATABASE_URL": f"sqlite:///{database}",
        "SECRET_KEY": "file-modes-test-" + "x" * 40,
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=PROJECT_ROOT, env=env, preexec_fn=loose_umask, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    made = sorted(tmp_path.glob("gateway.sqlite3*"))
    assert database in made
    assert {path.name: oct(mode(path)) for path in made} == {path.name: oct(0o600) for path in made}


def test_the_secret_key_recipe_writes_into_a_0600_file(tmp_path: Path) -> None:
    secret = tmp_path / ".gateway" / "secret_key"
    seen = tmp_path / "mode-while-writing"
    # Stands in for the virtualenv's Python in the recipe: records the umask its output file was
    # created under (the shell's redirection creates it with 0666 & ~umask) while it writes the secret.
    fake_python = tmp_path / "python"
    fake_python.write_text(f'#!/bin/sh\numask > {seen}\necho not-a-real-secret\n')
    fake_python.chmod(0o755)
    result = subprocess.run(
        ["make", "--no-print-directory", f"SECRET_FILE={secret}", f"PY={fake_python}", "STAMP=Makefile", str(secret)],
        cwd=PROJECT_ROOT, preexec_fn=loose_umask, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert secret.read_text().strip() == "not-a-real-secret"
    assert seen.read_text().strip() == "0077", "the secret was written into a file others could read"
    assert mode(secret) == 0o600
    assert mode(secret.parent) == 0o700
