r"""A chat prompt's token count: from a worker's own tokenizer where one offers it, else a
tokenizer-free estimate.

vLLM-compatible servers (and the simulated worker) answer `POST /tokenize` with `{"count": N}`
for a chat request. The estimate is used where no worker offers one, and where the gateway must
decide before any worker has seen the prompt (conditional disaggregation). It counts word and
punctuation pieces, which tracks BPE token counts of English prose and code within a factor of
about 1.3.

The pieces are those of `re.findall(r"\w+|[^\w\s]")` (a run of word characters is one piece, every
other non-space character is one), counted over the UTF-8 bytes with two `bytes.translate` passes
instead of the regex: it runs for every request, and over a Claude Code prompt (~20k tokens) the
regex cost several milliseconds of the gateway's CPU. For ASCII text the count is the regex's
exactly. Every non-ASCII byte counts as a word byte, so a non-ASCII letter counts as the regex
counts it, while a non-ASCII symbol or space joins the words beside it ("a—b" is one piece, not
three): the count differs from the regex's by at most 2 per non-ASCII character. Tools are
counted over their JSON, as chat templates render them (over Claude Code's 23 tools, 0.8 % more
pieces than their Python repr, counted before: JSON escapes `"` in strings where repr had `'`).

A client sends the same tools every turn (Claude Code: 24 tools, 64 KB of JSON, ~210 µs to count),
so their count is kept by a 128-bit hash of their JSON (~5 µs over those 64 KB).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import orjson
from xxhash import xxh3_128_intdigest

from workers.cluster.health import health
from workers.cluster.registry import PoolInfo
from workers.exceptions import WorkerError
from workers.wire import client

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 3.0

# The byte classes, taken from the regex the count stands for (so ASCII counts equal it by
# construction): word bytes (ASCII \w, and every byte of a non-ASCII character), spaces (ASCII \s),
# and the others, each a piece of its own as `[^\w\s]` counts it.
_WORD = bytes(b for b in range(128) if re.fullmatch(r"\w", chr(b))) + bytes(range(128, 256))
_OTHER = bytes(b for b in range(128) if re.fullmatch(r"[^\w\s]", chr(b)))
# Word bytes to b"a", every other byte to b" ": a run of word bytes then starts at each b" a" (or
# at the first byte).
_CLASS = bytes.maketrans(bytes(range(256)), bytes(ord("a") if b in _WORD else ord(" ") for b in range(256)))
# Per-message overhead of chat templates (role markers, separators).
_PER_MESSAGE = 4
# An image costs a roughly fixed number of tokens in vision models.
_PER_IMAGE = 256
# Tool lists whose pieces are kept (by their JSON's hash); emptied when full.
_TOOLS_CACHED = 256
_tools_pieces_by_hash: dict[int, int] = {}


async def count_prompt_tokens(pool: PoolInfo, chat: dict[str, Any]) -> int:
    """The prompt's token count by the first usable worker that tokenizes (context workers
    first), else the estimate."""
    body = {"model": chat.get("model"), "messages": chat.get("messages", []), "add_generation_prompt": True}
    if chat.get("tools"):
        body["tools"] = chat["tools"]
    for endpoint in sorted(pool.endpoints, key=lambda e: e.role != "context"):
        if not health.usable(endpoint):
            continue
        try:
            answer = await client.post_json(endpoint.url + "/tokenize", body, stage="tokenize", timeout=TOKENIZE_TIMEOUT_S)
        except WorkerError as exc:
            logger.debug("tokenize on %s failed: %s", endpoint.url, exc.message)
            continue
        count = answer.get("count")
        if isinstance(count, int) and count >= 0:
            return count
    return estimate_prompt_tokens(chat)


def estimate_prompt_tokens(chat: dict[str, Any], *, tools_json: bytes | None = None) -> int:
    """The estimate. `tools_json`, the chat's tools already serialized as one JSON list
    (`RenderedChat.tools`), saves serializing them again."""
    total = 0
    for message in chat.get("messages") or ():
        total += _PER_MESSAGE + _content_tokens(message.get("content"))
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            total += _text_tokens(str(function.get("name", ""))) + _text_tokens(str(function.get("arguments", "")))
        if message.get("reasoning_content"):
            total += _text_tokens(str(message["reasoning_content"]))
    tools = chat.get("tools") or ()
    if tools and tools_json is not None:
        # The list's brackets and commas are a piece each, and never join a tool's own pieces
        # (every element follows one of them): the tools' pieces are the list's less n + 1.
        total += _tools_pieces(tools_json) - len(tools) - 1
    else:
        for tool in tools:
            total += _pieces(_tool_json(tool))
    return total


# Characters counted per step of a long text: each step's C calls (encode, translate, count)
# hold the interpreter for a few milliseconds, not for the whole text (a 32 MiB text in one call
# held it ~100 ms, from the large-bodies thread, while the event loop waited for it).
_TEXT_SLICE = 1 << 20


def _text_tokens(text: str) -> int:
    # surrogatepass: a lone surrogate (possible in a str built outside the JSON parser) is counted
    # as the non-ASCII character it is rather than failing the request.
    if len(text) <= _TEXT_SLICE:
        return _pieces(text.encode("utf-8", "surrogatepass"))
    total, word_before = 0, False
    for start in range(0, len(text), _TEXT_SLICE):
        data = text[start : start + _TEXT_SLICE].encode("utf-8", "surrogatepass")
        total += _pieces(data)
        classes_first = data[:1].translate(_CLASS)
        if word_before and classes_first == b"a":
            total -= 1  # a word that runs on from the previous slice was counted as a new one
        word_before = data[-1:].translate(_CLASS) == b"a"
    return total


def _tools_pieces(tools_json: bytes) -> int:
    key = xxh3_128_intdigest(tools_json)
    pieces = _tools_pieces_by_hash.get(key)
    if pieces is None:
        pieces = _pieces(tools_json)
        if len(_tools_pieces_by_hash) >= _TOOLS_CACHED:
            _tools_pieces_by_hash.clear()
        _tools_pieces_by_hash[key] = pieces
    return pieces


def _pieces(data: bytes) -> int:
    others = len(data) - len(data.translate(None, _OTHER))
    classes = data.translate(_CLASS)
    return classes.count(b" a") + (classes[:1] == b"a") + others


def _tool_json(tool: Any) -> bytes:
    """The tool as JSON (a request's tools came from JSON, so this holds); anything orjson cannot
    write (a huge int, a non-str key from a caller outside the API) falls back to its repr."""
    try:
        return orjson.dumps(tool)
    except orjson.JSONEncodeError:
        return str(tool).encode("utf-8", "surrogatepass")


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return _text_tokens(content)
    total = 0
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text":
                total += _text_tokens(str(part.get("text", "")))
            elif part.get("type") == "image_url":
                total += _PER_IMAGE
    return total
