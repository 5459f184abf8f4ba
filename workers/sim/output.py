"""What the simulated model "generates" for a prompt: pure and deterministic.

The output is seeded by a hash of the prompt token ids, so the same prompt always yields the
same text whether it arrives as messages (aggregated) or as prompt_token_ids (disaggregated).
Each generated token is kept as its pre-encoded OpenAI `delta` object, ready to be framed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from .directives import Directives
from .tokenizer import VOCAB_SIZE
from .tools import arguments_json, split_fragments

# Non-ASCII words on purpose: they exercise UTF-8 splitting in every relay downstream.
WORDS: tuple[str, ...] = (
    "the", "model", "streams", "tokens", "through", "a", "gateway", "quickly",
    "context", "cache", "blocks", "move", "between", "workers", "and", "every",
    "answer", "arrives", "in", "order", "café", "naïve", "日本", "🌍",
    "résumé", "prefill", "decode", "latency", "is", "low", "today", "again",
)
DEFAULT_TOKENS = 16

PieceKind = Literal["reasoning", "content", "tool_header", "tool_args"]


def _encode(key: str, text: str) -> bytes:
    return orjson.dumps({key: text})


# Deltas of list words are shared, so streaming a list word allocates nothing but its frame.
_CACHE: dict[tuple[str, str], bytes] = {
    (key, prefix + word): _encode(key, prefix + word)
    for key in ("content", "reasoning")
    for prefix in ("", " ")
    for word in WORDS
}


def _delta(key: str, text: str) -> bytes:
    cached = _CACHE.get((key, text))
    return cached if cached is not None else _encode(key, text)


@dataclass(frozen=True, slots=True)
class Piece:
    """One generated token, before encoding."""

    kind: PieceKind
    text: str
    index: int = 0  # tool call index
    call_id: str = ""
    name: str = ""

    def delta(self) -> bytes:
        if self.kind == "content":
            return _delta("content", self.text)
        if self.kind == "reasoning":
            # vLLM's field (vllm/entrypoints/generate/base/protocol.py DeltaMessage.reasoning).
            return _delta("reasoning", self.text)
        if self.kind == "tool_header":
            call = {
                "index": self.index,
                "id": self.call_id,
                "type": "function",
                "function": {"name": self.name, "arguments": ""},
            }
            return orjson.dumps({"tool_calls": [call]})
        fragment = {"index": self.index, "function": {"arguments": self.text}}
        return orjson.dumps({"tool_calls": [fragment]})


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class Generation:
    """The whole answer: per-token deltas for streaming, joined fields for JSON."""

    deltas: list[bytes]
    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str
    stop_reason: str | None = None
    first_token_id: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.deltas)

    def message(self) -> dict[str, Any]:
        """The non-streamed `choices[0].message`, in vLLM's shape: its OpenAI fields null when
        unused, `tool_calls` only when there are some, `reasoning` (null when none)."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if self.tool_calls:
            message["tool_calls"] = [call.as_message() for call in self.tool_calls]
            if not self.content:
                message["content"] = None
        message["reasoning"] = self.reasoning or None
        return message


def prompt_seed(prompt_token_ids: Sequence[Any]) -> int:
    digest = hashlib.blake2b(orjson.dumps(list(prompt_token_ids)), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _words_as_pieces(kind: PieceKind, words: Sequence[str]) -> list[Piece]:
    return [Piece(kind, word if i == 0 else " " + word) for i, word in enumerate(words)]


def _tool_pieces(
    rng: random.Random, directives: Directives, tools: list[Any] | None
) -> list[Piece]:
    name = directives.tool_call or ""
    arguments = arguments_json(tools, name, invalid=directives.tool_args_invalid)
    calls = []
    for index in range(directives.tool_calls):
        call_id = f"call_{rng.getrandbits(96):024x}"
        header = Piece("tool_header", "", index, call_id, name)
        fragments = [Piece("tool_args", f, index) for f in split_fragments(arguments)]
        calls.append([header, *fragments])
    # Round-robin over the calls (index 0 piece, index 1 piece, ...) so that parallel calls
    # arrive interleaved, the way a real parser emits them.
    pieces: list[Piece] = []
    for round_ in range(max(len(c) for c in calls)):
        pieces.extend(call[round_] for call in calls if round_ < len(call))
    return pieces


def _cut_at_stop(pieces: list[Piece], stop: Sequence[str]) -> tuple[list[Piece], str] | None:
    """Pieces up to (not including) the earliest stop string in the content, and that string."""
    content = "".join(p.text for p in pieces if p.kind == "content")
    found = [(content.find(s), s) for s in stop if s in content]
    if not found:
        return None
    cut, matched = min(found)
    kept: list[Piece] = []
    offset = 0
    for piece in pieces:
        if piece.kind != "content":
            kept.append(piece)
            continue
        if offset + len(piece.text) <= cut:
            kept.append(piece)
            offset += len(piece.text)
            continue
        head = piece.text[: cut - offset]
        if head:
            kept.append(Piece("content", head))
        break
    return kept, matched


def plan_generation(
    prompt_token_ids: Sequence[Any],
    directives: Directives,
    *,
    tools: list[Any] | None = None,
    limit: int,
    stop: Sequence[str] = (),
) -> Generation:
    """The answer to a prompt, at most `limit` tokens long."""
    seed = prompt_seed(prompt_token_ids)
    rng = random.Random(seed)
    # Never draw more than limit + 1 words: enough to see the limit was hit, and a huge
    # `tokens=` cannot make the worker build a huge list.
    most = max(limit, 0) + 1
    pieces = _words_as_pieces("reasoning", rng.choices(WORDS, k=min(directives.reasoning, most)))
    if directives.say is not None:
        content_words = directives.say.split()
    else:
        default = 0 if directives.tool_call else DEFAULT_TOKENS
        count = directives.tokens if directives.tokens is not None else default
        content_words = rng.choices(WORDS, k=min(count, most))
    pieces += _words_as_pieces("content", content_words)
    if directives.tool_call:
        pieces += _tool_pieces(rng, directives, tools)

    truncated = len(pieces) > limit
    if truncated:
        pieces = pieces[: max(limit, 0)]
    stop_reason: str | None = None
    if stop and (cut := _cut_at_stop(pieces, stop)) is not None:
        pieces, stop_reason = cut
        truncated = False

    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        if piece.kind == "tool_header":
            calls[piece.index] = ToolCall(piece.call_id, piece.name)
        elif piece.kind == "tool_args":
            calls[piece.index].arguments += piece.text
    if truncated:
        finish = "length"
    elif stop_reason is None and calls:
        finish = "tool_calls"
    else:
        finish = "stop"
    return Generation(
        deltas=[piece.delta() for piece in pieces],
        reasoning="".join(p.text for p in pieces if p.kind == "reasoning"),
        content="".join(p.text for p in pieces if p.kind == "content"),
        tool_calls=[calls[i] for i in sorted(calls)],
        finish_reason=finish,
        stop_reason=stop_reason,
        first_token_id=seed % VOCAB_SIZE,
    )
