"""The parts of an OpenAI chat request the simulator acts on, validated once on arrival."""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .directives import Directives, parse_messages
from .error_answers import SimError

RequestType = Literal["plain", "context_only", "generation_only"]


@dataclass(frozen=True, slots=True)
class DisaggParams:
    """A request's disaggregation, neutral of the engine dialect that carried it
    (`workers.sim.dialects` reads each dialect's wire form into this)."""

    request_type: RequestType
    disagg_request_id: int | None
    ctx_request_id: int | None
    #: The state a context-first take presents (None for a rendezvous).
    encoded_opaque_state: str | None
    #: Base HTTP URL of the context sim holding the KV (the dialect translates its engine's
    #: address into it).
    kv_source_url: str | None
    schedule_style: str | None
    #: A generation-first (or concurrent) take: wait for the context phase of this id to finish,
    #: instead of taking a handoff that must already be held.
    rendezvous: bool = False
    #: A context request asks for the prompt's ids as base64 int32 (TensorRT-LLM's
    #: `return_prompt_token_ids_b64`) instead of a JSON array.
    prompt_ids_b64: bool = False

    @property
    def handoff_id(self) -> int | None:
        """The id a handoff is filed under: ctx_request_id, falling back to disagg_request_id."""
        return self.ctx_request_id if self.ctx_request_id is not None else self.disagg_request_id


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: list[Any]
    tools: list[Any] | None
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    stop: tuple[str, ...]
    disagg: DisaggParams | None
    prompt_token_ids: list[int] | None
    directives: Directives
    #: The engine's prefix-cache salt (`Dialect.cache_salt_field`): its KV blocks are apart from
    #: other salts'.
    cache_salt: str | None = None
    #: vLLM's `return_token_ids`: the answer carries the prompt's token ids (the first chunk's
    #: `prompt_token_ids`).
    return_token_ids: bool = False

    @property
    def request_type(self) -> RequestType:
        return self.disagg.request_type if self.disagg else "plain"


def _bad(message: str, param: str | None = None) -> SimError:
    return SimError(400, message, param=param)


def optional_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer", name)
    return value


def optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _stop_strings(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,) if raw else ()
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(s for s in raw if s)
    raise _bad("stop must be a string or a list of strings", "stop")


def parse_chat_request(
    body: Any, disagg: Callable[[Mapping[str, Any]], DisaggParams | None] | None = None, *, salt_field: str | None = None
) -> ChatRequest:
    """Validate a /v1/chat/completions body; raises SimError(400) on a malformed one.

    `disagg` reads the body's disaggregation in the worker's dialect (None: read none);
    `salt_field` names its prefix-cache salt (None: the engine has none, and ignores the field)."""
    if not isinstance(body, Mapping):
        raise _bad("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad("messages must be a list", "messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    max_tokens = optional_int(body.get("max_completion_tokens"), "max_completion_tokens")
    if max_tokens is None:
        max_tokens = optional_int(body.get("max_tokens"), "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise _bad("max_tokens must be at least 1", "max_tokens")
    prompt_token_ids = body.get("prompt_token_ids")
    if prompt_token_ids is not None and not isinstance(prompt_token_ids, list):
        raise _bad("prompt_token_ids must be a list of integers", "prompt_token_ids")
    if prompt_token_ids is None and body.get("prompt_token_ids_b64") is not None:
        prompt_token_ids = decode_token_ids_b64(body["prompt_token_ids_b64"])
    options = body.get("stream_options")
    options = options if isinstance(options, Mapping) else {}
    include_usage = bool(options.get("include_usage"))
    return ChatRequest(
        messages=messages,
        tools=tools,
        max_tokens=max_tokens,
        stream=bool(body.get("stream")),
        include_usage=include_usage,
        continuous_usage=include_usage and bool(options.get("continuous_usage_stats")),
        stop=_stop_strings(body.get("stop")),
        disagg=disagg(body) if disagg is not None else None,
        prompt_token_ids=prompt_token_ids,
        directives=parse_messages(messages),
        cache_salt=_cache_salt(body, salt_field) if salt_field else None,
        return_token_ids=body.get("return_token_ids") is True,
    )


def encode_token_ids_b64(ids: list[int]) -> str:
    """Token ids as TensorRT-LLM's context worker writes `prompt_token_ids_b64`: a base64 int32
    little-endian buffer."""
    return base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode("ascii")


def decode_token_ids_b64(text: Any) -> list[int]:
    """`prompt_token_ids_b64` read back as TensorRT-LLM's server reads it (numpy's int32 over the
    decoded bytes); what it could not read is a 400."""
    try:
        if not isinstance(text, str):
            raise ValueError("not a string")
        raw = base64.b64decode(text, validate=True)
        if len(raw) % 4:
            raise ValueError("not a whole number of int32s")
    except (ValueError, binascii.Error) as exc:
        raise _bad(f"prompt_token_ids_b64 is not a base64 int32 buffer: {exc}", "prompt_token_ids_b64") from None
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def _cache_salt(body: Mapping[str, Any], field: str) -> str | None:
    salt = body.get(field)
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt.strip():
        # vLLM's (and TensorRT-LLM's) words for it.
        raise _bad(f"Parameter '{field}' must be a non-empty string if provided.", field)
    return salt
