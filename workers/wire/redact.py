"""Worker error text made fit for a client, for the audit row and for the log: pure functions.

    client_text(raw)   # the engine's message alone: no traceback, address, path, URL or secret
    audit_text(raw)    # everything an operator needs, secrets masked
    log_text(raw)      # the raw text, bounded

A worker's error body is written by its engine for its operators: a FastAPI 500 may carry a
Python traceback naming `/opt/tensorrt_llm/...`, the address of the peer it failed to reach, or a
key from its configuration. The client sees only what is left of the message once those are
removed; the operator keeps the rest. Every function bounds its output, so a worker cannot make
the gateway store or show megabytes of error text.
"""

from __future__ import annotations

import re

from disagg_project import loggable

CLIENT_LIMIT = 500
AUDIT_LIMIT = 4000
LOG_LIMIT = 4096

_ELLIPSIS = "…"

# --- credentials ---------------------------------------------------------------------------------

_SECRET_NAMES = (
    r"api[_-]?key|x-api-key|apikey|access[_-]?key(?:[_-]?id)?|secret(?:[_-]?key)?|client[_-]?secret"
    r"|(?:access|auth|api|bearer|refresh|id|session)[_-]?token|password|passwd|pwd|authorization|cookie"
    r"|session[_-]?id|private[_-]?key|credentials?"
)
# `name=value`, `name: value`, `"name": "value"`; the value may be quoted or follow a scheme word.
_ASSIGNED = re.compile(
    rf"(?i)\b((?:{_SECRET_NAMES})[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token)\s+)?)[^\s\"',;&}}<>]+"
)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{6,}")
_TOKEN_SHAPES = re.compile(
    r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{6,}"  # OpenAI-style keys
    r"|\bhf_[A-Za-z0-9]{10,}"  # Hugging Face
    r"|\bgh[pousr]_[A-Za-z0-9]{10,}"  # GitHub
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"  # Slack
    r"|\bAKIA[0-9A-Z]{16}\b"  # AWS access key id
    r"|\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"  # a JWT
)
_URL_USERINFO = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://)[^\s/@:]+:[^\s/@]+@")

# --- addresses and paths (client text only) ------------------------------------------------------

_TRACEBACK = "Traceback (most recent call last):"
_URL = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s\"'<>)\]]+")
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.]+\](?::\d{1,5})?")
_IPV4 = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b")
_HOST_PORT = re.compile(r"(?i)\b(?:localhost|[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)+):\d{1,5}\b")
_PATH_PART = r"[\w.@%+~-]"
_PATH = re.compile(
    rf"(?<![\w.:/-])(?:~|\.{{1,2}})?/{_PATH_PART}+(?:/{_PATH_PART}*)+"  # /opt/x/y, ~/x/y, ./x/y
    rf"|(?<![\w.:/-])/{_PATH_PART}+\.(?:py|pyc|so|c|cc|cpp|cu|h|hpp|json|ya?ml|toml|txt|log|sock|bin|pt|safetensors)\b"
    r"|\b[A-Za-z]:\\[^\s\"']+"  # C:\x\y
)
_FILE_LINE = re.compile(r'^\s*File ".*", line \d+.*$', re.M)
_SPACE = re.compile(r"\s+")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def mask_credentials(text: str) -> str:
    """`text` with anything shaped like a key, token or password replaced by `<redacted>`."""
    text = _URL_USERINFO.sub(r"\1<redacted>@", text)
    text = _ASSIGNED.sub(r"\1<redacted>", text)
    text = _BEARER.sub(r"\1 <redacted>", text)
    return _TOKEN_SHAPES.sub("<redacted>", text)


def client_text(raw: str, limit: int = CLIENT_LIMIT) -> str:
    """The part of a worker's error message a client may see, on one line, at most `limit` chars."""
    text = _last_exception_message(raw)
    text = _FILE_LINE.sub("", text)
    text = _URL.sub("<url>", text)  # first: a URL's user:password goes with it
    text = mask_credentials(text)
    text = _IPV6.sub("<address>", text)
    text = _IPV4.sub("<address>", text)
    text = _HOST_PORT.sub("<address>", text)
    text = _PATH.sub("<path>", text)
    text = _SPACE.sub(" ", _CONTROL.sub("", text)).strip()
    return _bounded(text, limit)


def audit_text(raw: str, limit: int = AUDIT_LIMIT) -> str:
    """The worker's error for the audit row: addresses and paths kept, credentials masked."""
    return _bounded(mask_credentials(_CONTROL.sub("", raw)).strip(), limit)


def log_text(raw: str, limit: int = LOG_LIMIT) -> str:
    """The worker's raw error for the log, bounded and on one line (a worker is untrusted: its
    newlines would forge log lines, its escapes drive the reader's terminal)."""
    return loggable(_bounded(raw, limit))


def _last_exception_message(text: str) -> str:
    """A Python traceback reduced to its last exception's message (`ValueError: x` → `x`); text
    before the first traceback (an engine's own prefix) is kept."""
    head, found, tail = text.partition(_TRACEBACK)
    if not found:
        return text
    lines = [line for line in tail.splitlines() if line.strip()]
    # The exception line is the last one not indented (frames and source lines are).
    last = next((line for line in reversed(lines) if not line[:1].isspace()), "")
    if _TRACEBACK in last:
        last = ""
    exception, colon, message = last.partition(": ")
    if colon and re.fullmatch(r"[\w.]+", exception):
        last = message
    elif re.fullmatch(r"[\w.]+", last):
        last = ""  # a bare exception name says nothing useful to a client
    return f"{head.strip()} {last.strip()}".strip()


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + _ELLIPSIS


__all__ = ["audit_text", "client_text", "log_text", "mask_credentials"]
