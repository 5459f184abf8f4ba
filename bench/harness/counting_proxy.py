#!/usr/bin/env python
"""A counting HTTP/1.1 proxy in front of sim workers: what an engine sees, counted at every arrival.

    .venv/bin/python bench/harness/counting_proxy.py --upstream http://127.0.0.1:8001 \
        --upstream http://127.0.0.1:8002 [--engine-slots 8]

One process, one listening port per upstream (printed as `counting_proxy <i> <upstream>
listening on http://HOST:PORT`), and a control port (`counting_proxy control listening on ...`).
A measuring instrument of bench/tenants.py, not a product.

Counted: every `POST` (a chat completion) from its arrival until its response ends, per endpoint
and per tenant across all endpoints. The tenant is read from the request body: the first
`zzTENANTzz:<name>:` in it (the benchmark writes it into each prompt; the gateway passes the
prompt's text on). The maximum of each count is kept per *epoch* (`POST /epoch?name=N` starts
one; `GET /stats` answers them all as JSON), and every arrival that took a count above its watched
bound (`cap=` per endpoint, `tenant_caps=name:n,...` per tenant, given with the epoch) is counted
as a violation: the check holds at every arrival, not at sampled moments.

A request's count ends when the proxy reads the end of its response from the worker (`data:
[DONE]`, the last chunk, or the Content-Length), before it forwards those bytes: the gateway can
only free its slot after they reach it, so a request it sends on the freed slot always arrives
after the count went down. A request whose client (the gateway) leaves ends when the proxy sees
the connection close.

`--engine-slots N` also makes each endpoint an engine that runs at most N requests at once (as an
engine's max batch): later ones wait in a first-come-first-served queue in front of the worker
(nothing is sent to the worker meanwhile), and leave it if their client goes. 0: no limit.
Other requests (health probes) pass through, neither counted nor queued.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.wire.chunked import ChunkedDecoder

MARKER = b"zzTENANTzz:"
_DONE = b"data: [DONE]"
_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class Epoch:
    def __init__(self, name: str, cap: int | None, tenant_caps: dict[str, int]) -> None:
        self.name = name
        self.started = time.time()
        self.closed_at: float | None = None
        self.cap = cap
        self.tenant_caps = tenant_caps
        self.endpoint_max: dict[str, int] = {}
        self.endpoint_max_queued: dict[str, int] = {}
        self.endpoint_requests: dict[str, int] = {}
        self.endpoint_violations: dict[str, int] = {}
        self.tenant_max: dict[str, int] = {}
        self.tenant_requests: dict[str, int] = {}
        self.tenant_violations: dict[str, int] = {}
        # Time-weighted: request-seconds in flight per tenant and per endpoint (running, at the engine).
        self.tenant_area: dict[str, float] = {}
        self.running_area: dict[str, float] = {}

    def add_area(self, areas: dict[str, float], name: str, count: int, since: float, now: float) -> None:
        if since < self.started:
            since = self.started
        if now > since:
            areas[name] = areas.get(name, 0.0) + count * (now - since)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "started": self.started, "cap": self.cap, "tenant_caps": self.tenant_caps,
            "endpoint_max": self.endpoint_max, "endpoint_max_queued": self.endpoint_max_queued,
            "endpoint_requests": self.endpoint_requests, "endpoint_violations": self.endpoint_violations,
            "tenant_max": self.tenant_max, "tenant_requests": self.tenant_requests,
            "tenant_violations": self.tenant_violations,
            "ended": self.ended,
            "tenant_mean_in_flight": {k: v / max(1e-9, self.ended - self.started) for k, v in self.tenant_area.items()},
            "endpoint_mean_running": {k: v / max(1e-9, self.ended - self.started) for k, v in self.running_area.items()},
        }

    @property
    def ended(self) -> float:
        return self.closed_at if self.closed_at is not None else time.time()


class Hub:
    def __init__(self) -> None:
        self.tenant_in_flight: dict[str, int] = {}
        self.tenant_changed: dict[str, float] = {}
        self.endpoints: list[Endpoint] = []
        self.epochs: list[Epoch] = [Epoch("start", None, {})]

    def tenant_change(self, tenant: str, delta: int) -> int:
        now = time.time()
        count = self.tenant_in_flight.get(tenant, 0)
        epoch = self.epoch
        epoch.add_area(epoch.tenant_area, tenant, count, self.tenant_changed.get(tenant, now), now)
        self.tenant_changed[tenant] = now
        count = self.tenant_in_flight[tenant] = count + delta
        return count

    def new_epoch(self, epoch: Epoch) -> None:
        """Close the current epoch's areas at now and start the next."""
        now = epoch.started
        old = self.epoch
        for tenant, count in self.tenant_in_flight.items():
            old.add_area(old.tenant_area, tenant, count, self.tenant_changed.get(tenant, now), now)
            self.tenant_changed[tenant] = now
        for endpoint in self.endpoints:
            endpoint.note_running(now)
        old.closed_at = now
        self.epochs.append(epoch)

    @property
    def epoch(self) -> Epoch:
        return self.epochs[-1]


class Endpoint:
    def __init__(self, name: str, host: str, port: int, slots: int, hub: Hub) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.slots = slots
        self.hub = hub
        self.in_flight = 0
        self.running = 0
        self.running_changed = time.time()
        self.fifo: deque[Downstream] = deque()
        hub.endpoints.append(self)

    def note_running(self, now: float) -> None:
        epoch = self.hub.epoch
        epoch.add_area(epoch.running_area, self.name, self.running, self.running_changed, now)
        self.running_changed = now

    def arrive(self, conn: Downstream) -> None:
        hub, epoch, name, tenant = self.hub, self.hub.epoch, self.name, conn.tenant
        self.in_flight += 1
        epoch.endpoint_requests[name] = epoch.endpoint_requests.get(name, 0) + 1
        if self.in_flight > epoch.endpoint_max.get(name, 0):
            epoch.endpoint_max[name] = self.in_flight
        if epoch.cap is not None and self.in_flight > epoch.cap:
            epoch.endpoint_violations[name] = epoch.endpoint_violations.get(name, 0) + 1
        count = hub.tenant_change(tenant, +1)
        epoch.tenant_requests[tenant] = epoch.tenant_requests.get(tenant, 0) + 1
        if count > epoch.tenant_max.get(tenant, 0):
            epoch.tenant_max[tenant] = count
        bound = epoch.tenant_caps.get(tenant)
        if bound is not None and count > bound:
            epoch.tenant_violations[tenant] = epoch.tenant_violations.get(tenant, 0) + 1
        if self.slots and self.running >= self.slots:
            conn.phase = "queued"
            self.fifo.append(conn)
            if len(self.fifo) > epoch.endpoint_max_queued.get(name, 0):
                epoch.endpoint_max_queued[name] = len(self.fifo)
        else:
            self.note_running(time.time())
            self.running += 1
            conn.run()

    def leave(self, conn: Downstream) -> None:
        """The request's count ends (its response ended, or its client left)."""
        self.in_flight -= 1
        self.hub.tenant_change(conn.tenant, -1)
        if conn.phase == "queued":
            try:
                self.fifo.remove(conn)
            except ValueError:
                pass
        elif conn.phase == "running":
            self.note_running(time.time())
            self.running -= 1
            while self.fifo and (not self.slots or self.running < self.slots):
                nxt = self.fifo.popleft()
                self.running += 1
                nxt.run()
        conn.phase = "idle"


class Downstream(asyncio.Protocol):
    """A connection from the gateway; requests one at a time, each on a pinned worker connection."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.upstream: Upstream | None = None
        self._connecting = False
        self._buf = b""
        self._head = b""
        self._need = -1
        self._chunked: ChunkedDecoder | None = None
        self._body: list[bytes] = []
        self.wire = b""
        self.tenant = ""
        self.counted = False
        self.phase = "idle"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.counted:
            self.counted = False
            self.endpoint.leave(self)
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        self._buf = b""
        while buf:
            if self._need < 0 and self._chunked is None:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                self._head = buf[: end + 4]
                buf = buf[end + 4 :]
                lower = self._head.lower()
                if b"\r\ntransfer-encoding: chunked" in lower:
                    self._chunked = ChunkedDecoder()
                    self._raw: list[bytes] = []
                else:
                    i = lower.find(b"\r\ncontent-length:")
                    self._need = int(lower[i + 17 : lower.find(b"\r\n", i + 2)].strip()) if i >= 0 else 0
                self._body = []
            if self._chunked is not None:
                self._chunked.feed(buf)
                if not self._chunked.done:
                    self._raw.append(buf)
                    buf = b""
                    break
                left = self._chunked.leftover
                self._raw.append(buf[: len(buf) - len(left)] if left else buf)
                body_wire = b"".join(self._raw)
                self._chunked = None
                buf = left
                self._request(self._head, body_wire)
                continue
            if len(buf) < self._need:
                self._body.append(buf)
                self._need -= len(buf)
                buf = b""
                break
            self._body.append(buf[: self._need])
            buf = buf[self._need :]
            self._need = -1
            self._request(self._head, b"".join(self._body))
        self._buf = buf

    def _request(self, head: bytes, body: bytes) -> None:
        self.wire = head + body
        if not head.startswith(b"POST "):
            self.counted = False
            self.phase = "running"
            self.run()
            return
        i = body.find(MARKER)
        if i >= 0:
            j = body.find(b":", i + len(MARKER))
            self.tenant = body[i + len(MARKER) : j].decode(errors="replace") if j > 0 else "?"
        else:
            self.tenant = "-"
        self.counted = True
        self.endpoint.arrive(self)

    def run(self) -> None:
        self.phase = "running"
        if self.transport is None or self.transport.is_closing():
            return
        up = self.upstream
        if up is not None and up.transport is not None and not up.transport.is_closing():
            up.begin()
            up.transport.write(self.wire)
        elif not self._connecting:
            self._connecting = True
            asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        up = Upstream(self)
        try:
            await asyncio.get_running_loop().create_connection(lambda: up, self.endpoint.host, self.endpoint.port)
        except OSError:
            self.response_ended()
            if self.transport is not None:
                self.transport.write(_BAD_GATEWAY)
                self.transport.close()
            return
        finally:
            self._connecting = False
        self.upstream = up
        if self.transport is None or self.transport.is_closing():
            assert up.transport is not None
            up.transport.close()
            return
        up.begin()
        assert up.transport is not None
        up.transport.write(self.wire)

    def response_ended(self) -> None:
        if self.counted:
            self.counted = False
            self.endpoint.leave(self)
        else:
            self.phase = "idle"


class Upstream(asyncio.Protocol):
    """The worker connection of one gateway connection: bytes forwarded unchanged, parsed only to
    find where each response ends."""

    def __init__(self, owner: Downstream) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self._head = b""
        self._in_head = False
        self._decoder: ChunkedDecoder | None = None
        self._remaining = -1
        self._tail = b""
        self._ended = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.owner.upstream is self:
            self.owner.upstream = None
        if not self._ended:
            self._ended = True
            self.owner.response_ended()
            if self.owner.transport is not None:
                self.owner.transport.close()

    def begin(self) -> None:
        self._head = b""
        self._in_head = True
        self._decoder = None
        self._remaining = -1
        self._tail = b""
        self._ended = False

    def data_received(self, data: bytes) -> None:
        if not self._ended and self._scan(data):
            self._ended = True
            self.owner.response_ended()
        if self.owner.transport is not None:
            self.owner.transport.write(data)

    def _scan(self, data: bytes) -> bool:
        """Whether the response ends in `data` (or its `[DONE]` arrived)."""
        if self._in_head:
            buf = self._head + data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._head = buf
                return False
            head = buf[:end].lower()
            self._in_head = False
            data = buf[end + 4 :]
            if b"\r\ntransfer-encoding: chunked" in head:
                self._decoder = ChunkedDecoder()
            else:
                i = head.find(b"\r\ncontent-length:")
                if i >= 0:
                    j = head.find(b"\r\n", i + 2)
                    self._remaining = int(head[i + 17 : j if j >= 0 else len(head)].strip())
                elif head[9:12] in (b"204", b"304"):
                    self._remaining = 0
                else:
                    self._remaining = -1  # to the connection's close
            if self._remaining == 0:
                return True
            if not data:
                return False
        if self._decoder is not None:
            payload = self._decoder.feed(data)
            if self._decoder.done:
                return True
            text = self._tail + payload
            if _DONE in text:
                return True
            self._tail = text[-(len(_DONE) - 1) :]
            return False
        if self._remaining > 0:
            self._remaining -= len(data)
            return self._remaining <= 0
        return False


async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hub: Hub) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        line = head.split(b"\r\n", 1)[0].decode()
        method, target = line.split(" ")[:2]
        parts = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if method == "POST" and parts.path == "/epoch":
            caps = {}
            for item in filter(None, query.get("tenant_caps", "").split(",")):
                name, _, n = item.partition(":")
                caps[name] = int(n)
            cap = int(query["cap"]) if query.get("cap") else None
            hub.new_epoch(Epoch(query.get("name", f"epoch{len(hub.epochs)}"), cap, caps))
            body = json.dumps({"ok": True}).encode()
        elif parts.path == "/stats":
            body = json.dumps({"epochs": [e.as_dict() for e in hub.epochs], "tenant_in_flight": hub.tenant_in_flight}).encode()
        else:
            body = b"{}"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%b"
                     % (len(body), body))
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def serve(upstreams: list[str], slots: int, host: str) -> None:
    loop = asyncio.get_running_loop()
    hub = Hub()
    servers = []
    for i, url in enumerate(upstreams):
        parts = urlsplit(url)
        assert parts.hostname and parts.port, url
        endpoint = Endpoint(url, parts.hostname, parts.port, slots, hub)
        server = await loop.create_server(lambda e=endpoint: Downstream(e), host, 0, backlog=4096)  # type: ignore[misc]
        servers.append(server)
        bound = server.sockets[0].getsockname()
        print(f"counting_proxy {i} {url} listening on http://{bound[0]}:{bound[1]}", flush=True)
    ctl = await asyncio.start_server(lambda r, w: control(r, w, hub), host, 0)
    bound = ctl.sockets[0].getsockname()
    print(f"counting_proxy control listening on http://{bound[0]}:{bound[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", action="append", required=True, help="a worker's base URL (repeatable)")
    parser.add_argument("--engine-slots", type=int, default=0, help="requests an endpoint runs at once; later ones queue (0: no limit)")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    asyncio.run(serve(args.upstream, args.engine_slots, args.host))


if __name__ == "__main__":
    main()
