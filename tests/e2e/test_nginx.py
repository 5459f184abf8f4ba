"""nginx in front of the gateway, configured by deploy/nginx/disagg-gateway.conf, over TLS.

A real nginx (Debian's package) runs as an unprivileged-prefix process on this test's own
directory, with the site file rendered for the test (the gateway's address as the upstream, free
loopback ports, a self-signed certificate made here) and nothing else changed, in front of the
suite's daphne gateway and sim workers. Through it: a stream whose context phase is slow gets its
status line and `ping` frames as the gateway writes them (nginx buffers nothing), and a client
that hangs up still cancels the worker's request. (The gateway's streams also carry
`X-Accel-Buffering: no`; with `proxy_buffering on` plus `proxy_ignore_headers X-Accel-Buffering`
the first test fails: the status line came ~2 s late, with the answer.)

Skips without the nginx binary unless REQUIRE_NGINX=1 (.ci/run sets it), which makes that a
failure. Locally: `apt-get install -y nginx`.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import os
import pwd
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import h11
import httpx
import pytest

from tests.support.cluster import Cluster, audit_row, reservations_closed, wait_until
from tests.support.gateway import DEFAULT_ENV, PROJECT_ROOT, Gateway
from tests.support.ports import unused_port
from tests.support.rawclient import RawStream

SITE = PROJECT_ROOT / "deploy" / "nginx" / "disagg-gateway.conf"
START_WAIT = float(DEFAULT_ENV["MESSAGES_STREAM_START_WAIT_S"])
PING_INTERVAL = float(DEFAULT_ENV["MESSAGES_PING_INTERVAL_S"])
TLS_NAME = "localhost"

pytestmark = pytest.mark.django_db(transaction=True)


def nginx_binary() -> str:
    """The nginx binary; skips (or fails, with REQUIRE_NGINX=1) when it is not installed."""
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
    if found is None:
        if os.environ.get("REQUIRE_NGINX") == "1":
            pytest.fail("REQUIRE_NGINX=1 but there is no nginx binary (apt-get install -y nginx)")
        pytest.skip("needs nginx (apt-get install -y nginx)")
    return found


# --- the site file, rendered for the test ----------------------------------------------------------


def render_site(text: str, *, upstream: str, http_port: int, https_port: int, cert: Path, key: Path) -> str:
    """The site with the test's addresses and certificate: each directive replaced must occur
    exactly once, so a change of the file's shape fails here rather than testing something else."""
    replacements = [
        (r"^(\s*)server 127\.0\.0\.1:8000;", f"server {upstream};"),
        (r"^(\s*)listen 80;", f"listen 127.0.0.1:{http_port};"),
        (r"^(\s*)listen 443 ssl;", f"listen 127.0.0.1:{https_port} ssl;"),
        (r"^(\s*)ssl_certificate\s+\S+;", f"ssl_certificate {cert};"),
        (r"^(\s*)ssl_certificate_key\s+\S+;", f"ssl_certificate_key {key};"),
    ]
    for pattern, directive in replacements:

        def indented(match: re.Match[str], directive: str = directive) -> str:
            return match.group(1) + directive

        text, count = re.subn(pattern, indented, text, flags=re.MULTILINE)
        assert count == 1, f"{SITE.name}: expected one line matching {pattern!r}, found {count}"
    return text


def main_conf(prefix: Path, site: Path) -> str:
    """nginx.conf around the site: everything nginx writes stays under the test's directory."""
    # As root, nginx's workers would switch to `nobody`, which cannot enter pytest's 0700 temp dirs.
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
    return (
        f"{user}worker_processes 1;\n"
        "events { worker_connections 512; }\n"
        "http {\n"
        f"    access_log {prefix}/access.log;\n"
        + "".join(f"    {kind}_temp_path {prefix}/{kind}_temp;\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        + f"    include {site};\n"
        "}\n"
    )


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(TLS_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "gateway.pem", directory / "gateway.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return cert_path, key_path


# --- nginx as a process --------------------------------------------------------------------------


@dataclass
class Nginx:
    process: subprocess.Popen[bytes]
    prefix: Path
    https_port: int
    http_port: int
    tls: ssl.SSLContext

    @property
    def https_url(self) -> str:
        return f"https://127.0.0.1:{self.https_port}"

    def error_log(self) -> str:
        try:
            return (self.prefix / "error.log").read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def accepts(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"nginx exited with {self.process.returncode}:\n{self.error_log()}")
        try:
            with socket.create_connection(("127.0.0.1", self.https_port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # fast shutdown: the master stops its workers
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def nginx(gateways: Callable[..., Gateway], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    binary = nginx_binary()
    gateway = gateways()  # the suite's default gateway, the one the `cluster` fixture registers with
    prefix = tmp_path_factory.mktemp("nginx")
    cert, key = self_signed_certificate(prefix)
    https_port, http_port = unused_port(), unused_port()
    site = prefix / SITE.name
    site.write_text(
        render_site(SITE.read_text(), upstream=f"127.0.0.1:{gateway.port}", http_port=http_port,
                    https_port=https_port, cert=cert, key=key)
    )
    conf = prefix / "nginx.conf"
    conf.write_text(main_conf(prefix, site))
    error_log = prefix / "error.log"
    command = [binary, "-p", f"{prefix}/", "-c", str(conf), "-e", str(error_log),
               "-g", f"daemon off; pid {prefix}/nginx.pid; error_log {error_log} info;"]
    checked = subprocess.run([*command, "-t"], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, f"nginx -t refused the rendered site:\n{checked.stderr}"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tls = ssl.create_default_context(cafile=str(cert))
    server = Nginx(process=process, prefix=prefix, https_port=https_port, http_port=http_port, tls=tls)
    try:
        wait_until(server.accepts, timeout=10, message=f"nginx never listened:\n{server.error_log()}")
        yield server
    finally:
        server.stop()


@pytest.fixture
def schedule_style() -> str:
    """One schedule is enough here: what is under test is the proxy, not the pipeline's order."""
    return "context_first"


# --- a streamed request over TLS -----------------------------------------------------------------


@dataclass
class TlsStream(RawStream):
    """tests/support/rawclient.py's RawStream (h11 framing, every frame timestamped, an abrupt
    hang-up) over a TLS connection."""

    tls: ssl.SSLContext = field(default_factory=ssl.create_default_context)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        raw = socket.create_connection((parts.hostname, parts.port), timeout=30)
        self.sock = self.tls.wrap_socket(raw, server_hostname=TLS_NAME)
        self._conn = h11.Connection(h11.CLIENT)
        headers = [("host", f"{parts.hostname}:{parts.port}"), ("content-length", str(len(self.body))), *self.headers.items()]
        request = h11.Request(method="POST", target=parts.path, headers=headers)
        self.sock.sendall(self._conn.send(request) + self._conn.send(h11.Data(data=self.body)) + self._conn.send(h11.EndOfMessage()))
        self.sent_at = time.monotonic()


def stream(nginx: Nginx, cluster: Cluster, text: str, max_tokens: int = 256) -> TlsStream:
    payload = {"model": cluster.model, "max_tokens": max_tokens, "stream": True, "messages": [{"role": "user", "content": text}]}
    headers = {k: v for k, v in cluster.headers().items() if k.lower() != "content-length"}
    return TlsStream(nginx.https_url + "/v1/messages", json.dumps(payload).encode(), headers, tls=nginx.tls)


def assert_cancelled(request_id: str, stage: str) -> dict[str, str]:
    row = audit_row(request_id)
    assert row.status == "cancelled" and row.stage == stage, (row.status, row.stage)
    outcomes = {r.stage: r.outcome for r in reservations_closed(request_id)}
    assert outcomes[stage] == "cancelled", outcomes
    return outcomes


# --- the tests -----------------------------------------------------------------------------------


def test_a_slow_context_phase_streams_its_status_line_and_pings_through_nginx(nginx: Nginx, cluster: Cluster) -> None:
    s = stream(nginx, cluster, "slow one [sim context_delay=2 tokens=3]")
    assert s.read_head() == 200
    # The status line left the gateway at the end of its start wait, and nginx passed it on.
    assert s.head_at is not None and s.head_at < 1.0, s.head_at
    assert s.response_headers["content-type"].startswith("text/event-stream")
    assert s.response_headers["request-id"].startswith("req_")
    first_ping = s.read_until("ping")
    assert first_ping.at < 1.0, first_ping.at
    frames = s.read_all()
    events = [f.event for f in frames]
    start = events.index("message_start")
    assert set(events[:start]) == {"ping"} and start >= 3, events
    assert events[-1] == "message_stop" and "error" not in events, events
    # Each ping arrived as it was written, not in a lump with the answer: no silent gap longer
    # than the interval (plus scheduling slack) before message_start, which came ~2 s in.
    times = [f.at for f in frames[: start + 1]]
    assert times[-1] - times[0] > 1.0, times
    assert max(b - a for a, b in itertools.pairwise(times)) < PING_INTERVAL + 0.3, times
    row = audit_row(s.response_headers["request-id"])
    assert row.status == "completed" and row.pings_sent >= 3


def test_a_client_hanging_up_mid_stream_cancels_the_generation(nginx: Nginx, cluster: Cluster) -> None:
    s = stream(nginx, cluster, "long answer [sim tokens=20000]", max_tokens=20000)
    s.read_until("content_block_delta")
    s.close()  # RST to nginx, which closes its connection to the gateway
    cluster.generation.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0, timeout=10)
    outcomes = assert_cancelled(s.response_headers["request-id"], "generation")
    assert outcomes["context"] == "success"
    assert cluster.context.stats()["kv_held"] == 0


def test_a_client_hanging_up_during_the_context_phase_cancels_it(nginx: Nginx, cluster: Cluster) -> None:
    s = stream(nginx, cluster, "abandon me [sim context_delay=30]")
    assert s.read_head() == 200
    s.read_until("ping")
    s.close()
    cluster.context.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0, timeout=10)
    assert_cancelled(s.response_headers["request-id"], "context")
    cluster.generation.wait_for(lambda st: st["active"] == 0)


def head_only_request(nginx: Nginx, headers: list[tuple[str, str]], timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """`POST /v1/messages` with these headers and none of the body they announce; the answer."""
    raw = socket.create_connection(("127.0.0.1", nginx.https_port), timeout=timeout)
    with nginx.tls.wrap_socket(raw, server_hostname=TLS_NAME) as sock:
        conn = h11.Connection(h11.CLIENT)
        sock.sendall(conn.send(h11.Request(method="POST", target="/v1/messages", headers=[("host", TLS_NAME), *headers])))
        status, answer_headers, body = 0, {}, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                answer_headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, answer_headers, body


def test_what_the_site_keeps_from_the_gateway(nginx: Nginx, gateways: Callable[..., Gateway]) -> None:
    # A declared body over MESSAGES_MAX_BODY_BYTES is refused by nginx before it is read, in
    # Anthropic's envelope, like the gateway's own refusal.
    status, headers, body = head_only_request(
        nginx, [("content-type", "application/json"), ("content-length", str(32 * 1024 * 1024 + 1))]
    )
    assert status == 413 and headers["content-type"] == "application/json", (status, headers, body)
    error = json.loads(body)
    assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
    # /metrics: the gateway serves it to loopback clients, which every request through nginx is;
    # the site never passes it on.
    assert httpx.get(gateways().url + "/metrics", timeout=10).status_code == 200
    client = httpx.Client(verify=nginx.tls, timeout=10)
    with client:
        assert client.get(nginx.https_url + "/metrics").status_code == 403
        assert client.get(nginx.https_url + "/health").status_code == 200
        assert client.head(nginx.https_url + "/").status_code == 200
        # Plain HTTP is only a redirect to HTTPS.
        plain = client.get(f"http://127.0.0.1:{nginx.http_port}/v1/messages")
        assert plain.status_code == 301 and plain.headers["location"].startswith("https://")


# What nginx logs at `error` for the refusals above; a client's hang-up is logged at `info`.
EXPECTED_ERRORS = ("client intended to send too large body", "access forbidden by rule")


def test_nginx_logged_no_errors_of_its_own(nginx: Nginx) -> None:
    """Last in the module: nothing above made nginx log an error (an upstream that failed, timed
    out or closed early) other than the refusals the site is meant to make."""
    serious = [
        line for line in nginx.error_log().splitlines()
        if re.search(r"\[(error|crit|alert|emerg)\]", line) and not any(text in line for text in EXPECTED_ERRORS)
    ]
    assert not serious, serious
