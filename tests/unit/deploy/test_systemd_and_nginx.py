"""deploy/: the systemd units and the nginx site agree with the gateway they run.

The units are parsed here (systemd's syntax: sections, `Key=value`, repeated keys, comments,
backslash continuations) and, where `systemd-analyze` exists, verified by systemd itself. The
nginx site is checked against the settings' defaults; tests/e2e/test_nginx.py runs it for real.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import socket
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[3]
SYSTEMD = PROJECT_ROOT / "deploy" / "systemd"
SOCKET = SYSTEMD / "disagg-gateway.socket"
SERVICE = SYSTEMD / "disagg-gateway.service"
NGINX_SITE = PROJECT_ROOT / "deploy" / "nginx" / "disagg-gateway.conf"

Unit = dict[str, list[tuple[str, str]]]


def parse_unit(path: Path) -> Unit:
    """A unit file as {section: [(key, value), ...]}, keys in order and repeated ones kept (as
    systemd.syntax(7) reads them); anything else is an error."""
    sections: Unit = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not pending and (not stripped or stripped[0] in "#;"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        stripped, pending = pending + stripped, ""
        if stripped.startswith("[") and stripped.endswith("]"):
            current = sections.setdefault(stripped[1:-1], [])
            continue
        key, sep, value = stripped.partition("=")
        assert sep and current is not None and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), (
            f"{path.name}:{number}: not `Key=value` inside a section: {line!r}"
        )
        current.append((key.strip(), value.strip()))
    assert not pending, f"{path.name}: ends inside a continued line"
    return sections


def values(unit: Unit, section: str, key: str) -> list[str]:
    return [value for name, value in unit.get(section, []) if name == key]


def one(unit: Unit, section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= set {len(found)} times: {found}"
    return found[0]


def seconds(value: str) -> float:
    """A systemd time span ("45", "45s", "1min 30s") in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


@cache
def default_settings() -> dict[str, Any]:
    """The settings' defaults: disagg_project.settings imported with no environment but SECRET_KEY."""
    names = ["GATEWAY_DRAIN_TIMEOUT_S", "MESSAGES_REQUEST_DEADLINE_S", "MESSAGES_MAX_BODY_BYTES", "MESSAGES_BODY_READ_TIMEOUT_S"]
    code = f"import json, disagg_project.settings as s; print(json.dumps({{n: getattr(s, n) for n in {names!r}}}))"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SECRET_KEY": "defaults-only"}
    out = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


# --- systemd -------------------------------------------------------------------------------------


def test_the_units_parse() -> None:
    socket_unit, service_unit = parse_unit(SOCKET), parse_unit(SERVICE)
    assert set(socket_unit) == {"Unit", "Socket", "Install"}
    assert set(service_unit) == {"Unit", "Service", "Install"}


def test_the_service_runs_manage_py_serve_itself() -> None:
    service = parse_unit(SERVICE)
    command = shlex.split(one(service, "Service", "ExecStart"))
    # The interpreter is what systemd starts, with no shell in between: `serve` takes the passed
    # socket only when LISTEN_PID is its own PID.
    assert Path(command[0]).is_absolute() and re.search(r"/python3?$", command[0]), command
    assert command[1:3] == ["manage.py", "serve"], command
    processes = command[command.index("--processes") + 1]
    assert int(processes) >= 1
    assert Path(one(service, "Service", "WorkingDirectory")).is_absolute()
    assert one(service, "Service", "Type") == "simple"
    assert (PROJECT_ROOT / "manage.py").exists()


def test_the_socket_and_the_service_name_each_other() -> None:
    socket_unit, service = parse_unit(SOCKET), parse_unit(SERVICE)
    # systemd pairs foo.socket with foo.service; the socket names it too.
    assert SOCKET.stem == SERVICE.stem
    assert values(socket_unit, "Socket", "Service") in ([], [SERVICE.name])
    assert SOCKET.name in one(service, "Unit", "Requires").split()
    assert SOCKET.name in one(service, "Unit", "After").split()
    # One listening socket shared by every daphne process, not one service per connection.
    assert one(socket_unit, "Socket", "Accept").lower() in ("no", "false", "0")
    listen = one(socket_unit, "Socket", "ListenStream")
    assert re.fullmatch(r"[\w.:\[\]-]+:\d+|\d+", listen), listen
    assert one(socket_unit, "Install", "WantedBy") == "sockets.target"


def test_stopping_waits_for_the_drain() -> None:
    service = parse_unit(SERVICE)
    assert one(service, "Service", "KillSignal") == "SIGTERM"
    # SIGTERM to `serve` only: it forwards one to each daphne process, which drains. systemd's
    # default (control-group) would signal the children too, and a second SIGTERM stops at once.
    assert one(service, "Service", "KillMode") == "mixed"
    # `serve` kills children still running GATEWAY_DRAIN_TIMEOUT_S + 10 s after the signal
    # (messages_api/management/commands/serve.py); systemd must not SIGKILL it all before that.
    drain = float(default_settings()["GATEWAY_DRAIN_TIMEOUT_S"])
    assert seconds(one(service, "Service", "TimeoutStopSec")) > drain + 10
    assert one(service, "Service", "Restart") == "on-failure"


def test_the_service_runs_unprivileged_and_confined() -> None:
    service = parse_unit(SERVICE)
    assert one(service, "Service", "User") not in ("", "root", "0")
    assert values(service, "Service", "EnvironmentFile"), "SECRET_KEY, DATABASE_URL, ... come from an EnvironmentFile"
    assert one(service, "Service", "NoNewPrivileges") == "yes"
    assert one(service, "Service", "ProtectSystem") == "strict"
    assert one(service, "Service", "PrivateTmp") == "yes"
    state = f"/var/lib/{one(service, 'Service', 'StateDirectory')}"
    writable = " ".join(values(service, "Service", "ReadWritePaths")).split()
    assert state in writable, (state, writable)
    assert int(one(service, "Service", "LimitNOFILE")) >= 65536


def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    """`systemd-analyze verify` on copies whose ExecStart names this interpreter (the real path
    exists only on a deployed host); systemd warns on stderr of every key it does not know."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (the units are still parsed above)")
    for unit in (SOCKET, SERVICE):
        text = unit.read_text()
        if unit == SERVICE:
            text = re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable}", text, flags=re.MULTILINE)
        (tmp_path / unit.name).write_text(text)
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(tmp_path / SOCKET.name), str(tmp_path / SERVICE.name)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_the_service_command_serves_on_the_socket_systemd_passes(tmp_path: Path) -> None:
    """The service's own command line (one daphne process instead of its N) under
    `systemd-socket-activate`, which passes a listening socket the way the .socket unit does: the
    gateway must announce and answer on that socket. `--port 0` is appended, so a gateway that
    binds one of its own shows up as a different port instead of colliding with another. (It
    did: importing Twisted's endpoints removed LISTEN_PID/LISTEN_FDS before `serve` read them;
    settings now reads them first.)"""
    activate = shutil.which("systemd-socket-activate")
    if activate is None:
        pytest.skip("systemd-socket-activate is not installed")
    from tests.support.ports import unused_port
    from workers.sim.process import stop_process

    command = shlex.split(one(parse_unit(SERVICE), "Service", "ExecStart"))
    command[0] = sys.executable
    command[command.index("--processes") + 1] = "1"
    port = unused_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SECRET_KEY": "socket-activation-test",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'gateway.sqlite3'}",
        "GATEWAY_DRAIN_TIMEOUT_S": "0",
        "HEALTH_CHECK_INTERVAL_S": "3600",
    }
    passed_env = [arg for name in env for arg in ("-E", name)]
    with open(tmp_path / "serve.log", "wb") as log:
        process = subprocess.Popen(
            [activate, "-l", f"127.0.0.1:{port}", *passed_env, *command, "--port", "0"],
            cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
        )
    try:
        # systemd-socket-activate starts the command on the first connection (as a .socket unit
        # can); that connection waits in the passed socket's backlog.
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except ConnectionRefusedError:  # not listening yet
                assert time.monotonic() < deadline and process.poll() is None, "systemd-socket-activate never listened"
                time.sleep(0.05)
        assert process.stdout is not None
        readable, _, _ = select.select([process.stdout], [], [], 30)
        assert readable, "serve announced nothing within 30 s"
        announced = process.stdout.readline().strip()
        assert announced == f"gateway on http://127.0.0.1:{port} with 1 daphne process(es)", announced
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
    finally:
        stop_process(process)


# --- nginx ---------------------------------------------------------------------------------------


def nginx_block(text: str, opening: str) -> str:
    """The text of the `{ ... }` block that starts with `opening` (e.g. `location /v1/`)."""
    start = text.index(opening + " {") + len(opening) + 2
    depth, index = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        index += 1
    return text[start : index - 1]


def directive(block: str, name: str) -> list[str]:
    """The arguments of each `name ...;` line of a block (comments dropped)."""
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [line[len(name):].strip().rstrip(";").strip() for line in lines if re.match(rf"{name}\s", line)]


def nginx_size(value: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", value).groups()  # type: ignore[union-attr]
    return int(number) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[unit.lower()]


def nginx_seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", value).groups()  # type: ignore[union-attr]
    return int(number) * {None: 1, "ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


def test_the_nginx_site_matches_the_gateway() -> None:
    site = NGINX_SITE.read_text()
    defaults = default_settings()
    # The upstream is the socket the units listen on.
    listen = one(parse_unit(SOCKET), "Socket", "ListenStream")
    assert directive(nginx_block(site, "upstream disagg_gateway"), "server") == [listen]
    tls_server = next(block for block in re.split(r"\nserver \{", site) if "ssl_certificate" in block)
    assert nginx_size(directive(tls_server, "client_max_body_size")[0]) == defaults["MESSAGES_MAX_BODY_BYTES"]
    assert str(defaults["MESSAGES_MAX_BODY_BYTES"]) in nginx_block(site, "location @request_too_large")
    assert directive(tls_server, "proxy_http_version") == ["1.1"]
    api = nginx_block(site, "location /v1/")
    assert directive(api, "proxy_buffering") == ["off"]
    assert directive(api, "proxy_request_buffering") == ["off"]
    assert directive(api, "gzip") == ["off"]
    for timeout in ("proxy_read_timeout", "proxy_send_timeout"):
        assert nginx_seconds(directive(api, timeout)[0]) > defaults["MESSAGES_REQUEST_DEADLINE_S"], timeout
    for timeout in ("client_header_timeout", "client_body_timeout"):
        assert nginx_seconds(directive(tls_server, timeout)[0]) >= defaults["MESSAGES_BODY_READ_TIMEOUT_S"], timeout
    assert directive(nginx_block(site, "location = /metrics"), "deny") == ["all"]
    assert "proxy_pass" in nginx_block(site, "location /admin/")
