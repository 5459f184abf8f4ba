"""Hostile requests for the gateway, as hypothesis strategies, and the judge of its answers.

Used by tests/e2e/test_fuzz.py (bounded, under pytest) and bench/fuzz.py (10,000 requests): the same
generators, so a benchmark finding reproduces as a test example and the other way round.

Every request is raw bytes sent on a fresh socket (`connection: close`), so nothing a well-behaved
client library would refuse to send is out of reach: invalid UTF-8, header names with spaces,
17 KiB headers, a body of nesting 100,000 deep. The answer must be, whatever was sent:
- a status below 500;
- when an error, Anthropic's envelope `{"type":"error","error":{"type","message"}...}` as JSON;
- when a success, a valid message (JSON) or a valid stream (SSE frames of JSON that end in
  `message_stop` or an `error` event);
- complete before the client's timeout (no hang).
"""

from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from tests.support.chunked import ChunkedFramingError, dechunk

# --- the requests ----------------------------------------------------------------------------------

Json = Any

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values: st.SearchStrategy[Json] = st.recursive(
    json_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=12), children, max_size=4)),
    max_leaves=20,
)


def deep(depth: int, kind: str) -> str:
    """A placeholder that `encode` turns into JSON nested `depth` deep (lists or objects): the
    stdlib encoder (and hypothesis) would recurse that deep, the wire does not need to."""
    return f"\x01deep:{depth}:{kind}\x01"


_DEEP = re.compile(rb'"\\u0001deep:(\d+):(list|dict)\\u0001"')
deep_values = st.builds(deep, st.sampled_from([64, 200, 253, 254, 255, 300, 1000, 1023, 1024, 1025, 5000]), st.sampled_from(["list", "dict"]))
huge_strings = st.builds(
    lambda n, c: c * n, st.sampled_from([70_000, 300_000, 1_000_000]), st.sampled_from(["a", "\u00e9", "\U0001f30d", "\\", '"', "\x00"])
)
hostile_values = st.one_of(json_values, json_values, json_values, deep_values, huge_strings)

# Every content block type the API knows, with plausible and implausible inner fields.
BLOCK_TYPES = [
    "text", "image", "document", "search_result", "thinking", "redacted_thinking", "tool_use", "tool_result",
    "server_tool_use", "web_search_tool_result", "container_upload", "tool_reference", "nonsense",
]
BLOCK_FIELDS = [
    "text", "source", "id", "name", "input", "content", "tool_use_id", "thinking", "signature", "data", "title", "citations",
    "is_error", "cache_control",
]
SOURCE_TYPES = ["base64", "url", "file", "text", "content", "nonsense"]


@st.composite
def content_blocks(draw: st.DrawFn) -> Json:
    block: dict[str, Json] = {"type": draw(st.sampled_from(BLOCK_TYPES))}
    for key in draw(st.lists(st.sampled_from(BLOCK_FIELDS), max_size=4, unique=True)):
        if key == "source":
            source: dict[str, Json] = {"type": draw(st.sampled_from(SOURCE_TYPES))}
            for skey in draw(st.lists(st.sampled_from(["media_type", "data", "url", "file_id", "content"]), max_size=3, unique=True)):
                source[skey] = draw(st.one_of(json_values, st.just("image/png"), st.just("aGVsbG8=")))
            block[key] = draw(st.one_of(st.just(source), json_values))
        elif key == "content":
            block[key] = draw(st.one_of(json_values, st.lists(st.deferred(lambda: content_blocks()), max_size=2)))
        else:
            block[key] = draw(st.one_of(json_values, deep_values) if key == "input" else json_values)
    return block


def base_request(model: str, stream: bool) -> dict[str, Json]:
    """A valid request touching most fields, so a mutation lands somewhere meaningful."""
    return {
        "model": model,
        "max_tokens": 8,
        "stream": stream,
        "system": [{"type": "text", "text": "Be brief."}],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "stop_sequences": ["\n\nHuman:"],
        "metadata": {"user_id": "fuzz"},
        "tools": [{"name": "lookup", "description": "d", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
        "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "found"}]}]},
        ],
    }


def _paths(value: Json, prefix: tuple[Json, ...] = ()) -> list[tuple[Json, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*prefix, index))
    return found


def _set(root: Json, path: tuple[Json, ...], value: Json, delete: bool) -> None:
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value


@st.composite
def hostile_json_bodies(draw: st.DrawFn, model: str) -> dict[str, Json]:
    """A valid request with one to three fields replaced, deleted or given extra blocks."""
    body = base_request(model, draw(st.booleans()))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "replace", "delete", "add_block", "add_key"]))
        if action == "add_block":
            message = draw(
                st.sampled_from([m for m in body.get("messages", []) if isinstance(m, dict) and isinstance(m.get("content"), list)] or [None])
            )
            if message is not None:
                message["content"].append(draw(content_blocks()))
            continue
        if action == "add_key":
            body[draw(st.text(max_size=10))] = draw(hostile_values)
            continue
        paths = _paths(body)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        _set(body, path, draw(hostile_values), delete=action == "delete")
    return body


@dataclass(frozen=True)
class HostileRequest:
    """Bytes to send, and what they were for a report."""

    method: str
    path: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    kind: str

    def wire(self, host: str) -> bytes:
        head = [f"{self.method} {self.path} HTTP/1.1".encode("latin-1"), b"host: " + host.encode()]
        names = {name.lower() for name, _ in self.headers}
        head += [name + b": " + value for name, value in self.headers]
        if b"content-length" not in names and b"transfer-encoding" not in names:
            head.append(b"content-length: %d" % len(self.body))
        head.append(b"connection: close")
        return b"\r\n".join(head) + b"\r\n\r\n" + self.body

    def describe(self) -> str:
        headers = [(n, v[:60] + (b"..." if len(v) > 60 else b"")) for n, v in self.headers if n != b"x-api-key"]
        return f"{self.kind}: {self.method} {self.path[:200]} headers={headers} body ({len(self.body)} bytes)[:300]={self.body[:300]!r}"


def api_headers(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"x-api-key", key.encode()), (b"anthropic-version", b"2023-06-01"), (b"content-type", b"application/json")]


def _dumps(value: Json) -> bytes:
    encoded = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return _DEEP.sub(lambda m: _deep_bytes(int(m.group(1)), m.group(2).decode()), encoded)


@st.composite
def json_requests(draw: st.DrawFn, key: str, model: str) -> HostileRequest:
    body = draw(hostile_json_bodies(model))
    return HostileRequest("POST", "/v1/messages", api_headers(key), _dumps(body), "json")


def _deep_bytes(depth: int, kind: str) -> bytes:
    opening, closing = (b"[", b"]") if kind == "list" else (b'{"a":', b"}")
    return opening * depth + b"1" + closing * depth


@st.composite
def byte_requests(draw: st.DrawFn, key: str, model: str) -> HostileRequest:
    """Bodies that are not JSON, not UTF-8, truncated, or deeper than any parser should go."""
    valid = _dumps(base_request(model, draw(st.booleans())))
    body = draw(
        st.one_of(
            st.binary(max_size=200),
            st.builds(lambda cut: valid[:cut], st.integers(0, len(valid) - 1)),
            st.builds(
                lambda junk, at: valid[:at] + junk + valid[at:],
                st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00", b"\xf4\x90\x80\x80"]),
                st.integers(0, len(valid)),
            ),
            st.builds(_deep_bytes, st.sampled_from([300, 1025, 100_000]), st.sampled_from(["list", "dict"])),
            st.sampled_from([b"", b"null", b"[]", b"1e999999", b'"x"', b"{}", b'{"model": NaN}', b'{"a":1,"a":2}', b"\xef\xbb\xbf{}"]),
        )
    )
    return HostileRequest("POST", draw(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"])), api_headers(key), body, "bytes")


_token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-_0123456789", min_size=1, max_size=20)
_bad_name = st.sampled_from([b"bad header", b"bad:name", b"\xff\xfe", b"", b"x-\x00", b"x-api-key ", b"(x)"])
_bad_value = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.sampled_from([b"\x00", b"\x7f", b"\xff", b"a\rb", b"x" * 17_000, b"x" * 70_000]),
)


@st.composite
def header_requests(draw: st.DrawFn, key: str, model: str) -> HostileRequest:
    """A valid body with hostile headers: bad names and values, huge or many headers, wrong
    content types and lengths, bad keys and versions."""
    headers = api_headers(key)
    choice = draw(st.sampled_from(["bad_name", "bad_value", "huge", "many", "content_type", "length", "key", "version", "duplicate", "te"]))
    body = _dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    if choice == "bad_name":
        headers.append((draw(_bad_name), b"v"))
    elif choice == "bad_value":
        headers.append((b"x-" + draw(_token).encode(), draw(_bad_value)))
    elif choice == "huge":
        headers.append((b"x-big", b"b" * draw(st.sampled_from([8_000, 16_500, 17_000, 65_000]))))
    elif choice == "many":
        headers += [(b"x-h%d" % i, b"v") for i in range(draw(st.sampled_from([100, 500, 2000])))]
    elif choice == "content_type":
        headers = [h for h in headers if h[0] != b"content-type"] + draw(
            st.sampled_from(
                [[], [(b"content-type", b"text/plain")], [(b"content-type", b"application/json; charset=latin-1")], [(b"content-type", b"\xff")]]
            )
        )
    elif choice == "length":
        headers.append((b"content-length", draw(st.sampled_from([b"-1", b"abc", b"99999999999999999999", b"1, 2", b"0"]))))
    elif choice == "key":
        headers = [h for h in headers if h[0] != b"x-api-key"] + draw(
            st.sampled_from(
                [[], [(b"x-api-key", b"")], [(b"x-api-key", b"\xff\xfe")], [(b"authorization", b"Bearer ")], [(b"x-api-key", b"k" * 5000)]]
            )
        )
    elif choice == "version":
        headers = [h for h in headers if h[0] != b"anthropic-version"] + [
            (b"anthropic-version", draw(st.binary(max_size=20).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))))
        ]
    elif choice == "duplicate":
        headers += [(b"x-api-key", b"other"), (b"content-type", b"application/json")]
    else:
        headers.append((b"transfer-encoding", draw(st.sampled_from([b"chunked", b"gzip", b"chunked, chunked", b"identity"]))))
    return HostileRequest("POST", "/v1/messages", headers, body, f"headers:{choice}")


@st.composite
def path_requests(draw: st.DrawFn, key: str, model: str) -> HostileRequest:
    """Unknown paths under /v1/, odd encodings of known ones, and wrong methods."""
    path = draw(
        st.one_of(
            st.builds(lambda t: "/v1/" + t, _token),
            st.sampled_from([
                "/v1/", "/v1", "/v1/messages/", "/v1/messages/batches", "/v1/complete", "/v1/messages?beta=true", "/v1/models/",
                "/v1/models/%00", "/v1/models/" + "m" * 3000, "/v1/%2e%2e/admin/", "/v1/messages/count_tokens/x", "/v1//messages",
            ]),
        )
    )
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"]))
    body = _dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}) if method in ("POST", "PUT", "PATCH") else b""
    return HostileRequest(method, path, api_headers(key), body, "path")


def known_json_cases(key: str, model: str) -> list[HostileRequest]:
    """The client inputs issue 9 found answered with 500, tried first on every run."""
    def with_block(block: Json, inside_tool_result: bool = False) -> HostileRequest:
        body = base_request(model, False)
        if inside_tool_result:
            body["messages"][2]["content"][0]["content"] = [block]
        else:
            body["messages"][0]["content"].append(block)
        return HostileRequest("POST", "/v1/messages", api_headers(key), _dumps(body), "json:known")

    deep_schema = base_request(model, False)
    deep_schema["tools"][0]["input_schema"]["properties"]["q"] = deep(254, "dict")
    deep_input = base_request(model, True)
    deep_input["messages"][1]["content"][0]["input"] = deep(300, "list")
    blocks = [
        {"type": "document", "source": {"type": "content", "content": 5}},
        {"type": "image"},
        {"type": "text", "text": 7},
        {"type": "image", "source": {"type": "url"}},
    ]
    cases = [with_block(b) for b in blocks] + [with_block(b, inside_tool_result=True) for b in blocks]
    return cases + [
        HostileRequest("POST", "/v1/messages", api_headers(key), _dumps(deep_schema), "json:known"),
        HostileRequest("POST", "/v1/messages", api_headers(key), _dumps(deep_input), "json:known"),
    ]


def known_other_cases(key: str, model: str) -> list[HostileRequest]:
    """Issue 9's answers outside the envelope: an unknown /v1/ path, a bad header, a 17 KiB header."""
    body = _dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    return [
        HostileRequest("GET", "/v1/unknown", api_headers(key), b"", "path:known"),
        HostileRequest("POST", "/v1/messages", [*api_headers(key), (b"bad header", b"v")], body, "headers:known"),
        HostileRequest("POST", "/v1/messages", [*api_headers(key), (b"x-big", b"b" * 17_000)], body, "headers:known"),
    ]


def any_request(key: str, model: str) -> st.SearchStrategy[HostileRequest]:
    return st.one_of(
        json_requests(key, model), json_requests(key, model), byte_requests(key, model), header_requests(key, model), path_requests(key, model)
    )


# --- the answers -----------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    hung: bool = False
    error: str = ""  # the transport-level failure, if any
    seconds: float = 0.0


def send(host: str, port: int, request: HostileRequest, timeout: float) -> Answer:
    """Send the raw request, read to the end (the server closes: `connection: close`)."""
    answer = Answer()
    started = time.monotonic()
    deadline = started + timeout
    data = bytearray()
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            try:
                sock.sendall(request.wire(f"{host}:{port}"))
            except OSError:
                pass  # the server may refuse early (413) and close while we still send: read it
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    answer.hung = True
                    break
                sock.settimeout(remaining)
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    answer.hung = True
                    break
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.seconds = time.monotonic() - started
    _parse_response(bytes(data), answer)
    return answer


def _parse_response(data: bytes, answer: Answer) -> None:
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return
    answer.status = int(parts[1])
    for line in lines[1:]:
        name, _, value = line.partition(":")
        answer.headers[name.strip().lower()] = value.strip()
    if answer.headers.get("transfer-encoding", "").lower() == "chunked":
        try:
            answer.body = dechunk(rest, complete=False)  # a hung answer's body is cut short
        except ChunkedFramingError as exc:
            # The gateway's framing broken: judged as an empty body, which only HEAD, 204 and 304 pass.
            answer.error = f"malformed chunked framing: {exc}"
    else:
        answer.body = rest


def _is_envelope(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and body.get("type") == "error"
        and isinstance(body.get("error"), dict)
        and isinstance(body["error"].get("type"), str)
        and isinstance(body["error"].get("message"), str)
    )


def _stream_problem(body: bytes) -> str:
    events: list[str] = []
    for raw in body.split(b"\n\n"):
        if not raw.strip():
            continue
        event, data_lines = "", []
        for line in raw.decode("utf-8", "replace").split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data_lines.append(line[5:].strip())
        if not data_lines:
            continue
        try:
            data = json.loads("\n".join(data_lines))
        except ValueError:
            return f"a malformed SSE frame: {raw[:200]!r}"
        if event == "error" and not _is_envelope(data):
            return f"an error event outside the envelope: {data!r}"
        events.append(event)
    if not events or events[-1] not in ("message_stop", "error"):
        return f"a stream that did not end in message_stop or error: {events[-5:]}"
    return ""


def problem(request: HostileRequest, answer: Answer) -> tuple[str, str]:
    """(category, detail) of what is wrong with `answer`; ("", "") when it is acceptable.

    Categories: hang, no_answer, 5xx, non_envelope."""
    if answer.hung:
        return "hang", f"no complete answer in time (status {answer.status})"
    if answer.status is None:
        return "no_answer", answer.error or "the connection closed without an HTTP answer"
    if answer.status >= 500:
        return "5xx", f"{answer.status}: {answer.body[:300]!r}"
    content_type = answer.headers.get("content-type", "")
    if answer.status == 200 and content_type.startswith("text/event-stream"):
        detail = _stream_problem(answer.body)
        return ("non_envelope", detail) if detail else ("", "")
    if request.method == "HEAD" or answer.status in (204, 304):
        return "", ""
    try:
        body = json.loads(answer.body)
    except ValueError:
        return "non_envelope", f"{answer.status} {content_type}: {answer.body[:300]!r}"
    if 200 <= answer.status < 300:
        ok = isinstance(body, dict) and (body.get("type") in ("message", "model") or "data" in body or "input_tokens" in body)
        return ("", "") if ok else ("non_envelope", f"{answer.status}: {body!r:.300}")
    if not _is_envelope(body):
        return "non_envelope", f"{answer.status}: {answer.body[:300]!r}"
    return "", ""
