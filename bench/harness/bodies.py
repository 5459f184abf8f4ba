"""Requests on the wire: Anthropic Messages bodies, whole HTTP/1.1 requests to a gateway or a
worker, ready to send with the lean client."""

from __future__ import annotations

import json
from typing import Any

MODEL = "sim-model"
ANTHROPIC_VERSION = "2023-06-01"


def messages_body(directive: str, *, stream: bool, model: str = MODEL, max_tokens: int = 100000, text: str = "Hello") -> bytes:
    return json.dumps(
        {
            "model": model,
            "max_tokens": max_tokens,
            "stream": stream,
            "messages": [{"role": "user", "content": f"{text} {directive}".strip()}],
        },
        separators=(",", ":"),
    ).encode()


def build_request(method: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"host: 127.0.0.1:{port}", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def gateway_request(port: int, key: str, body: bytes) -> bytes:
    return build_request(
        "POST",
        port,
        "/v1/messages",
        body,
        {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION, "content-type": "application/json"},
    )


def worker_request(port: int, payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return build_request("POST", port, "/v1/chat/completions", body, {"content-type": "application/json"})


def port_of(url: str) -> int:
    return int(url.rstrip("/").rsplit(":", 1)[1])
