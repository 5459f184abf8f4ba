"""OpenAI `chat.completion.chunk`s → Anthropic stream events, one chunk at a time, no I/O.

The Anthropic stream is strictly sequential: `message_start`,
then blocks `0..n` each as start / deltas / stop, never two open at once, then
`message_delta` and `message_stop`. The SDK accumulators index `content[index]` (TypeScript
reads `content.at(-1)`), so indices must be contiguous and blocks must not interleave.

Upstream, reasoning, text and several tool calls can arrive in any order, and parallel tool
calls can interleave their argument fragments by `index`. So:

- a change of kind (thinking → text → tool_use) closes the open block and opens the next;
- the tool call holding the open block streams; fragments of other calls are buffered and each
  is emitted as its own block once the open one closes. The open call closes early when
  another call's fragment arrives and its arguments already parse as a JSON object (a complete
  object can only be followed by whitespace), so calls streamed one after another stream live;
- a tool call's arguments are checked when its block closes, which is the last moment the
  client can still be told before it acts on them.

The gateway enforces `max_tokens` itself (a worker may ignore it, and one that streamed 90 MB for
`max_tokens: 64` was relayed whole). It counts what it relays, in tokens:

- each piece of content (a text or thinking delta, a tool call's name or argument fragment)
  counts one token: a piece carries at least one, so a worker that honours the limit never sends
  more pieces than `max_tokens`;
- the characters of long pieces (more than `CHARS_PER_TOKEN`) count too, one token per
  `CHARS_PER_TOKEN` of them beyond the first `LONG_PIECE_ALLOWANCE`: a flood of few, huge pieces
  is bounded by its characters. Short pieces (almost every token) are not measured, and one long
  token (a run of indentation) is not taken for several: only an answer whose long pieces average
  more than `CHARS_PER_TOKEN` characters per token, past the allowance, counts more tokens than it
  has;
- the count is the larger of the two (`relayed_tokens`).

Content is relayed while the count stays within `max_tokens`: the piece that would take it past
is cut there, within the piece (the prefix that fits, which a long piece always has), and a piece
arriving once the count has reached the limit is not relayed. Either way `feed` raises
`OutputLimitReached` (a `StopRelay`: the run stops reading the worker and cancels its request) and
`finish` ends the message with stop_reason `max_tokens`. So what is relayed is at most
`max_tokens` pieces and `max_tokens × CHARS_PER_TOKEN + LONG_PIECE_ALLOWANCE` characters of long
ones (plus at most `CHARS_PER_TOKEN` per short piece), and `output_tokens` (the worker's count, or
this one where it is larger) is never more than `max_tokens`.

This runs once per generated token, so the text path is a handful of dict lookups and one
event dict; nothing is copied.

Micro-benchmark (this machine, Python 3.11; tests/unit/messages_api/test_reframe.py::test_text_chunk_cost prints it
with -s): ~0.4-0.5 µs per text chunk for `feed`, ~0.8-0.9 µs with `sse.encode_event` of its
event, against a 10 µs budget.
"""

from __future__ import annotations

import logging
import secrets
import sys
from typing import Any, NoReturn

import orjson

from messages_api.cache_accounting import split_prompt
from messages_api.errors import AnthropicError, ApiInternalError
from messages_api.framing import text_delta_frame
from workers import StopRelay

__all__ = ["CHARS_PER_TOKEN", "LONG_PIECE_ALLOWANCE", "OutputLimitReached", "StreamReframer"]

logger = logging.getLogger(__name__)

TEXT = "text"
THINKING = "thinking"
TOOL_USE = "tool_use"

# Every finish_reason an engine can end a choice with, mapped deliberately (see `_on_finish_reason`
# for the rest). Sources: TensorRT-LLM `executor/result.py` (CompletionOutput.finish_reason:
# stop, length, timeout, cancelled) and `serve/postprocess_handlers.py` (tool_calls); vLLM
# `v1/engine/__init__.py` FINISH_REASON_STRINGS (stop, length, abort, error, repetition) and its
# chat server (tool_calls); SGLang (stop, length, abort; tool_calls); OpenAI (stop, length,
# tool_calls, function_call, content_filter).
FINISH_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    # OpenAI: the output was cut by its content filter; Anthropic's stop reason for a response
    # its classifiers stopped is `refusal`.
    "content_filter": "refusal",
}
# finish_reasons after which the output is cut short by design: a tool call's arguments may be
# incomplete JSON.
CUT_SHORT = frozenset({"length", "content_filter"})
# finish_reasons that mean the worker gave up: the output so far is not a finished answer, so
# ending the message with a success stop_reason would hand the client a truncated reply as a
# complete one. Each is an error instead (the HTTP error, or the `error` event once streaming):
# reason -> (status, why). The status decides Anthropic's error type (errors.py's table).
FAILED_FINISH_REASONS: dict[str, tuple[int, str]] = {
    # TensorRT-LLM: the request passed its deadline inside the engine.
    "timeout": (504, "The worker timed out before the answer was complete"),
    # TensorRT-LLM: the engine cancelled the request (not us: our cancel closes the stream).
    "cancelled": (500, "The worker cancelled the request before the answer was complete"),
    # vLLM, SGLang: aborted by the engine (shutdown, a failed KV transfer, an overload abort).
    "abort": (500, "The worker aborted the request before the answer was complete"),
    # vLLM: a request-level internal error (e.g. a KV load failure); vLLM itself answers it 500.
    "error": (500, "The worker failed before the answer was complete"),
    # vLLM: generation stopped because the output became a repetitive loop; what came so far is
    # neither complete nor usable.
    "repetition": (500, "The worker stopped a repetitive output before the answer was complete"),
    # TensorRT-LLM's context phase ends with it ("generation pending"): from a generation
    # stream it means the answer was never generated.
    "not_finished": (502, "The worker ended the stream before the answer was generated"),
}
# A finish_reason nobody documents: it may mean the worker gave up, so it is a failure too (a
# new success reason then shows up as an error, and in the log, instead of a truncated answer
# passing as complete). The reason itself is worker data: logged, never shown to the client.
UNKNOWN_FINISH_REASON = (502, "The worker ended the answer with a finish reason the gateway does not know")

BAD_ARGUMENTS = "The worker returned tool call arguments that are not a JSON object"

# Characters of content per token that a long piece is counted by (see the module): `max_tokens ×
# 16` characters of long pieces, plus the allowance, bound what a worker that ignores the limit gets
# relayed, however few its pieces. Why 16: a token is 3-4 characters of English text on average and
# rarely more than 16 (long words, runs of indentation), a CJK character is about one token, and an
# engine that sends several tokens per chunk sends their characters; so a worker that honours
# max_tokens stays below the bound, while one that floods gets about 16 bytes per token asked (64 KiB
# for max_tokens 4,096; at most four times that in UTF-8, six in JSON escapes, still linear in
# max_tokens). A piece of at most 16 characters (almost every token) is not measured: `text[16:]`
# is no call.
CHARS_PER_TOKEN = 16
# Characters of long pieces not counted: one token can be long (a run of spaces or of `=` in code),
# and with max_tokens 1 a single 40-character token would otherwise count 3 and be cut. A token of a
# byte-level BPE vocabulary is at most a few dozen to ~128 bytes; 256 covers it with room, and costs
# a flood 256 characters more.
LONG_PIECE_ALLOWANCE = 256
# `_stop_at` once the message is over: every piece is then past it.
_OVER = -1


class OutputLimitReached(StopRelay):
    """The worker sent more content than the request's `max_tokens`: nothing more is relayed,
    and `finish` ends the message there with stop_reason `max_tokens`."""


class _ToolCall:
    """One upstream tool call (keyed by its `index`) on its way to becoming a tool_use block."""

    __slots__ = ("key", "id", "name", "arguments", "started")

    def __init__(self, key: object, call_id: str | None, name: str | None) -> None:
        self.key = key
        # The worker's own id round-trips: the client sends it back as `tool_use_id`, the
        # converter turns that into `tool_call_id`, and some templates check its format.
        self.id = call_id or "toolu_" + secrets.token_hex(12)
        self.name = name
        self.arguments: list[str] = []
        self.started = False  # its content_block_start was emitted


class StreamReframer:
    """OpenAI chat.completion.chunk dicts in, Anthropic stream events (dicts) out.

    `feed` once per upstream chunk, then `finish` once at `[DONE]`, or `fail` once on any
    failure (including an `AnthropicError` raised by `feed`/`finish`). Nothing after that.
    """

    __slots__ = (
        "_message_id",
        "_model",
        "_stop_sequences",
        "_start_input_tokens",
        "_cache_share",
        "_started",
        "_done",
        "_index",
        "_open",
        "_open_call",
        "_calls",
        "_unindexed",
        "_emitted_tool_use",
        "_finish_reason",
        "_matched_stop",
        "_usage",
        "_out",
        "_relayed",
        "_stop_at",
        "_max_tokens",
        "_long_chars",
        "_long_limit",
        "stop_reason",
    )

    def __init__(
        self,
        *,
        message_id: str,
        model: str,
        input_tokens: int | None = None,
        stop_sequences: list[str] | None = None,
        cache_share: float = 0.0,
        max_tokens: int | None = None,
    ) -> None:
        """`cache_share`: the fraction of the prompt up to its last `cache_control` breakpoint
        (`messages_api.cache_accounting`), which the usage reports as cache creation where the
        worker did not read it from its cache. `max_tokens`: the request's, enforced here (see
        the module); None, no limit."""
        self._message_id = message_id
        #: The message's stop_reason once `finish` ended it ("" before, and after a failure).
        self.stop_reason = ""
        self._model = model
        self._stop_sequences = frozenset(stop_sequences or ())
        self._start_input_tokens = input_tokens or 0
        self._cache_share = cache_share
        self._started = False
        self._done = False
        self._index = -1
        self._open: str | None = None  # kind of the open block
        self._open_call: _ToolCall | None = None  # the call owning the open tool_use block
        self._calls: dict[object, _ToolCall] = {}  # insertion order = block order
        self._unindexed = 0
        self._emitted_tool_use = False
        self._finish_reason: str | None = None
        self._matched_stop: object = None
        self._usage: dict[str, Any] | None = None  # the latest upstream usage, unconverted
        # Events of the feed/finish call in progress. If that call raises, the caller never
        # receives them, so `fail` sends them ahead of the error (and `finish`, ahead of the end,
        # after `OutputLimitReached`).
        self._out: list[dict[str, Any]] | None = None
        # Pieces relayed (see the module), and the count at which the next piece of content ends
        # the message instead: `max_tokens`, or the pieces so far once the characters of long
        # pieces brought the count to it (_OVER once it is over: `text_frame` then takes nothing,
        # the one comparison standing for all three).
        self._relayed = 0
        self._stop_at = max_tokens if max_tokens is not None else sys.maxsize
        self._max_tokens = max_tokens
        # Characters of long pieces relayed, and how many the count allows (`_measure`).
        self._long_chars = 0
        self._long_limit = max_tokens * CHARS_PER_TOKEN + LONG_PIECE_ALLOWANCE if max_tokens is not None else sys.maxsize

    # -- public ------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """Whether `message_start` has been emitted."""
        return self._started

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt: the worker's count, or the estimate until it reports one."""
        usage = self._usage
        if usage is None or usage.get("prompt_tokens") is None:
            return self._start_input_tokens
        prompt_tokens: int = usage["prompt_tokens"]
        return prompt_tokens

    @property
    def input_tokens(self) -> int:
        """The prompt's tokens neither read from nor written to the cache."""
        return self._split()[0]

    @property
    def cache_creation_input_tokens(self) -> int:
        return self._split()[1]

    def _split(self) -> tuple[int, int, int]:
        return split_prompt(self.prompt_tokens, _cached_tokens(self._usage) if self._usage is not None else 0, self._cache_share)

    @property
    def output_tokens(self) -> int:
        """The worker's count, or what was relayed (`relayed_tokens`) when that is more (a worker
        that reports none, or too few, is not taken at its word); never more than `max_tokens` (a
        worker that ignored it generated more than was relayed)."""
        usage = self._usage
        reported: int = (usage.get("completion_tokens") or 0) if usage is not None else 0
        relayed = self.relayed_tokens
        counted = reported if reported > relayed else relayed
        limit = self._max_tokens
        return counted if limit is None or counted <= limit else limit

    @property
    def relayed_tokens(self) -> int:
        """The content relayed, in tokens as counted here (see the module): one per piece, or the
        characters of long pieces past the allowance, one per CHARS_PER_TOKEN, when they say more."""
        by_chars = -(-(self._long_chars - LONG_PIECE_ALLOWANCE) // CHARS_PER_TOKEN)
        return by_chars if by_chars > self._relayed else self._relayed

    @property
    def cache_read_input_tokens(self) -> int:
        """Prompt tokens the worker read from its prefix cache (not in `input_tokens`; at most the prompt)."""
        return self._split()[2]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One parsed upstream chunk → the events it completes (possibly none)."""
        out: list[dict[str, Any]] = []
        self._out = out
        usage = chunk.get("usage")
        if usage:
            self._usage = usage
        if not self._started:
            self._start(out)
        choices = chunk.get("choices")
        if choices:
            choice = choices[0]  # Anthropic has no `n`: one choice
            delta = choice.get("delta")
            if delta:
                # vLLM has used both names, and some versions send both with the same text.
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning:
                    # Counted inline, here and below: this is a reasoning model's per-token path.
                    if self._relayed >= self._stop_at:
                        self._limit_reached()
                    self._relayed += 1
                    if reasoning[CHARS_PER_TOKEN:]:
                        self._long_delta(THINKING, reasoning, out)
                    else:
                        self._content_delta(THINKING, {"type": "thinking_delta", "thinking": reasoning}, out)
                text = delta.get("content")
                if text:
                    if self._relayed >= self._stop_at:
                        self._limit_reached()
                    self._relayed += 1
                    if text[CHARS_PER_TOKEN:]:
                        self._long_delta(TEXT, text, out)
                    else:
                        self._content_delta(TEXT, {"type": "text_delta", "text": text}, out)
                tool_calls = delta.get("tool_calls")
                if tool_calls:
                    self._tool_calls(tool_calls, out)
            finish_reason = choice.get("finish_reason")
            if finish_reason:
                self._on_finish_reason(finish_reason, choice)
        self._out = None
        return out

    def text_frame(self, chunk: dict[str, Any]) -> bytes | None:
        """The SSE frame for `chunk` when it is one more text token on the open text block (the
        chunk of almost every generated token), with the state `feed` would leave; None for any
        other chunk, which `feed` takes instead.

        The frame is what `encode_event` gives for the `content_block_delta` `feed` would return,
        built without the event dict (sse.text_delta_frame). At the output limit, or once the
        message is over (`_stop_at` is then _OVER), `feed` decides."""
        if self._open != TEXT or self._relayed >= self._stop_at:
            return None
        choices = chunk.get("choices")
        if not choices:
            return None
        choice = choices[0]
        delta = choice.get("delta")
        if not delta or choice.get("finish_reason"):
            return None
        text = delta.get("content")
        # A piece longer than CHARS_PER_TOKEN counts more than one token: `feed` measures it.
        if not text or text[CHARS_PER_TOKEN:] or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls"):
            return None
        usage = chunk.get("usage")
        if usage:
            self._usage = usage
        self._relayed += 1
        return text_delta_frame(self._index, text)

    def finish(self) -> list[dict[str, Any]]:
        """Upstream sent `[DONE]`: close the open block, then `message_delta` and `message_stop`."""
        if self._done:
            return []
        # After OutputLimitReached, the events of the feed it cut short come first.
        out: list[dict[str, Any]] = self._out or []
        self._out = out
        if not self._started:
            self._start(out)
        self._close_block(out)
        if self._calls:
            self._drain_waiting_calls(out)
            self._close_block(out)
        stop_reason, stop_sequence = self._stop_reason()
        self.stop_reason = stop_reason
        out.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": self._usage_fields(self.output_tokens),
            }
        )
        out.append({"type": "message_stop"})
        self._done = True
        self._stop_at = _OVER
        self._out = None
        return out

    def fail(self, error_event: dict[str, Any]) -> list[dict[str, Any]]:
        """A failure mid-stream: close the open block, then `error_event`; never `message_stop`.

        Before `message_start` only the error event is returned.
        """
        if self._done:
            return []
        self._done = True
        self._stop_at = _OVER
        out = self._out or []
        self._out = None
        if not self._started:
            return [error_event]
        if self._open is not None:
            out.append({"type": "content_block_stop", "index": self._index})
            self._open = None
            self._open_call = None
        out.append(error_event)
        return out

    # -- message -----------------------------------------------------------------------------

    def _start(self, out: list[dict[str, Any]]) -> None:
        self._started = True
        out.append(
            {
                "type": "message_start",
                "message": {
                    "id": self._message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": self._model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    # Always present: Claude Code and the TypeScript SDK write into it.
                    "usage": self._usage_fields(0),
                },
            }
        )

    def _usage_fields(self, output_tokens: int) -> dict[str, Any]:
        # The cache counts are always present (zero when unknown), as the real API sends them:
        # clients add them up for their context meters, and the streamed and non-streamed
        # answers then carry the same usage.
        uncached, creation, cached = self._split()  # once: the three come from one split
        return {
            "input_tokens": uncached,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": cached,
        }

    def _on_finish_reason(self, finish_reason: str, choice: dict[str, Any]) -> None:
        if finish_reason not in FINISH_REASONS:
            failure = FAILED_FINISH_REASONS.get(finish_reason)
            if failure is None:
                logger.warning("unknown finish_reason from a worker: %r", finish_reason[:64])
                failure = UNKNOWN_FINISH_REASON
            status, why = failure
            raise AnthropicError(status, why)
        self._finish_reason = finish_reason
        # vLLM/TRT-LLM name the matched stop string in `stop_reason` (an int is a stop token id);
        # SGLang calls it `matched_stop`.
        matched = choice.get("stop_reason")
        if matched is None:
            matched = choice.get("matched_stop")
        self._matched_stop = matched

    def _long_delta(self, block_type: str, piece: str, out: list[dict[str, Any]]) -> None:
        """A thinking or text piece longer than CHARS_PER_TOKEN (already counted as a piece): its
        characters counted, and its delta, cut where the count reaches max_tokens (which then ends
        the message)."""
        # `_measure`, inlined: this is the path of every chunk of an engine that sends several
        # tokens at once.
        long_chars = self._long_chars + len(piece)
        room = self._long_limit - long_chars
        if room < CHARS_PER_TOKEN:
            self._long_delta_at_the_limit(block_type, piece, out)
            return
        self._long_chars = long_chars
        delta = {"type": "thinking_delta", "thinking": piece} if block_type == THINKING else {"type": "text_delta", "text": piece}
        self._content_delta(block_type, delta, out)

    def _long_delta_at_the_limit(self, block_type: str, piece: str, out: list[dict[str, Any]]) -> None:
        """`_long_delta` of a piece that brings the count to max_tokens, or would take it past."""
        fits = self._measure(piece)
        delta = {"type": "thinking_delta", "thinking": fits} if block_type == THINKING else {"type": "text_delta", "text": fits}
        self._content_delta(block_type, delta, out)
        if fits is not piece:
            self._limit_reached()

    def _measure(self, piece: str) -> str:
        """Count a long piece's characters (see the module); what of it may be relayed: the whole
        piece, or (a new string) the prefix that brings the count to max_tokens. Once the count is
        at max_tokens, the next piece ends the message."""
        room = self._long_limit - self._long_chars
        if len(piece) > room:
            # At least CHARS_PER_TOKEN characters: below that the count was at the limit already.
            piece = piece[:room]
        self._long_chars += len(piece)
        if self._long_limit - self._long_chars < CHARS_PER_TOKEN:  # one more character counts max_tokens + 1
            self._stop_at = self._relayed
        return piece

    def _limit_reached(self) -> NoReturn:
        """A piece of content past `max_tokens`: it is not relayed, and the message ends here, as
        an answer cut by max_tokens is (`finish`: stop_reason max_tokens, a tool call's arguments
        left as they are). The events of the current `feed` stay in `_out` for `finish`."""
        logger.warning(
            "the worker sent more than max_tokens=%s: the answer ends there (%d tokens relayed, as counted)",
            self._max_tokens,
            self.relayed_tokens,
        )
        self._finish_reason = "length"
        self._matched_stop = None
        self._stop_at = _OVER
        raise OutputLimitReached()

    def _stop_reason(self) -> tuple[str, str | None]:
        reason = self._finish_reason
        stop_sequence = None
        matched = self._matched_stop
        if reason in (None, "stop") and isinstance(matched, str) and matched in self._stop_sequences:
            stop_reason, stop_sequence = "stop_sequence", matched
        else:
            # No finish_reason at all (a stream that only said [DONE]): the worker stopped on its own.
            stop_reason = FINISH_REASONS[reason] if reason is not None else "end_turn"
        # Clients run tools only on stop_reason "tool_use"; a truncated or filtered turn still
        # says so (a filtered turn's tools must not run).
        if self._emitted_tool_use and stop_reason not in ("max_tokens", "refusal"):
            return "tool_use", None
        return stop_reason, stop_sequence

    # -- blocks ------------------------------------------------------------------------------

    def _content_delta(self, block_type: str, delta: dict[str, Any], out: list[dict[str, Any]]) -> None:
        """A thinking or text delta, opening its block first when another one is open."""
        if self._open != block_type:
            start = {"type": THINKING, "thinking": "", "signature": ""} if block_type == THINKING else {"type": TEXT, "text": ""}
            self._begin_block(start, out)
        out.append({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _begin_block(self, content_block: dict[str, Any], out: list[dict[str, Any]]) -> None:
        """Open a text or thinking block, after closing the open one and any buffered calls."""
        self._close_block(out)
        if self._calls:
            self._drain_waiting_calls(out)
            self._close_block(out)
        self._index += 1
        self._open = content_block["type"]
        out.append({"type": "content_block_start", "index": self._index, "content_block": content_block})

    def _close_block(self, out: list[dict[str, Any]]) -> None:
        if self._open is None:
            return
        if self._open_call is not None:
            # Arguments cut off by max_tokens (or by a content filter) are expected to be
            # incomplete: the answer is a truncated tool_use block with stop_reason max_tokens
            # (refusal), as Anthropic's own API gives, and no client runs it.
            if self._finish_reason not in CUT_SHORT:
                # Raised before the stop is emitted, so `fail` closes the block itself.
                _parse_arguments(self._open_call)
            self._open_call = None
        out.append({"type": "content_block_stop", "index": self._index})
        self._open = None

    # -- tool calls --------------------------------------------------------------------------

    def _tool_calls(self, tool_calls: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
        for tool_call in tool_calls:
            function = tool_call.get("function")
            arguments = function.get("arguments") if function else None
            # A call's name or an argument fragment is content (a flood of new calls too).
            cut = False
            if arguments or (function and function.get("name")):
                if self._relayed >= self._stop_at:
                    self._limit_reached()
                self._relayed += 1
                if arguments and arguments[CHARS_PER_TOKEN:]:
                    fits = self._measure(arguments)
                    cut = fits is not arguments
                    arguments = fits
            call = self._call_for(tool_call)
            if (
                call is not self._open_call
                and not call.started
                and call.name
                and (self._open != TOOL_USE or self._open_call_complete())
            ):
                # The earliest waiting call takes the block, so blocks follow upstream order.
                self._start_tool_block(self._first_waiting_call(), out)
            if not arguments:
                continue
            call.arguments.append(arguments)
            if call is self._open_call:
                out.append(
                    {
                        "type": "content_block_delta",
                        "index": self._index,
                        "delta": {"type": "input_json_delta", "partial_json": arguments},
                    }
                )
            elif call.started and arguments.strip():
                # Its block is closed, and a closed call's arguments were a whole JSON object.
                raise ApiInternalError(BAD_ARGUMENTS)
            if cut:  # the fragment took the count to max_tokens: nothing after it
                self._limit_reached()

    def _call_for(self, tool_call: dict[str, Any]) -> _ToolCall:
        function = tool_call.get("function") or {}
        name = function.get("name")
        key = tool_call.get("index")
        if key is None:
            # Without an index only a name says a new call began; a bare fragment continues
            # the open call, or else the latest one.
            if name or not self._calls:
                self._unindexed += 1
                key = ("unindexed", self._unindexed)
            elif self._open_call is not None:
                key = self._open_call.key
            else:
                key = next(reversed(self._calls))
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _ToolCall(key, tool_call.get("id"), name)
        elif not call.started:
            # Some producers repeat id and name on every fragment; late values fill gaps only.
            if name and not call.name:
                call.name = name
            if tool_call.get("id"):
                call.id = tool_call["id"]
        return call

    def _open_call_complete(self) -> bool:
        """Whether the open call's arguments already form a JSON object (so nothing can follow)."""
        call = self._open_call
        if call is None or not call.arguments or not call.arguments[-1].rstrip().endswith("}"):
            return False
        try:
            return isinstance(orjson.loads("".join(call.arguments)), dict)
        except orjson.JSONDecodeError:
            return False

    def _first_waiting_call(self) -> _ToolCall:
        return next(call for call in self._calls.values() if not call.started and call.name)

    def _start_tool_block(self, call: _ToolCall, out: list[dict[str, Any]]) -> None:
        self._close_block(out)
        self._index += 1
        self._open = TOOL_USE
        self._open_call = call
        call.started = True
        self._emitted_tool_use = True
        out.append(
            {
                "type": "content_block_start",
                "index": self._index,
                "content_block": {"type": TOOL_USE, "id": call.id, "name": call.name, "input": {}},
            }
        )
        for fragment in call.arguments:
            out.append(
                {
                    "type": "content_block_delta",
                    "index": self._index,
                    "delta": {"type": "input_json_delta", "partial_json": fragment},
                }
            )

    def _drain_waiting_calls(self, out: list[dict[str, Any]]) -> None:
        """Emit every call still buffered as a complete block of its own (the last left open)."""
        for call in self._calls.values():
            if call.started:
                continue
            if not call.name:
                raise ApiInternalError("The worker returned a tool call without a name")
            self._start_tool_block(call, out)


def _cached_tokens(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details")
    return (details.get("cached_tokens") or 0) if details else 0


def _parse_arguments(call: _ToolCall) -> dict[str, Any]:
    text = "".join(call.arguments)
    if not text.strip():
        return {}
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ApiInternalError(BAD_ARGUMENTS)
    return value
