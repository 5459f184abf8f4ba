"""Hand-written validation of Messages and count_tokens request bodies.

Plain dict checks instead of pydantic models: the body is already parsed by orjson, and walking
it once here costs far less than building a model tree per request. Each failure raises a 400
`invalid_request_error` whose message starts with the field path, in the words the real API
uses (pydantic's: "Field required", "Input should be ..."), e.g.
`messages.2.content.0.type: Input tag 'foo' found using 'type' does not match any of the
expected tags: ...`.

Unknown top-level fields are tolerated: Claude Code sends `context_management`,
`output_config`, `diagnostics`, `service_tier`, `container`, `cache_control`, `betas`, and
rejecting any of them is a known way to break it (peer gateways have). A `null`
optional field counts as absent, as the SDKs' own types allow for most of them.

Every content block is checked to the field, directly or inside a `tool_result` or a document's
`content` source, so that nothing a client sends can surprise the converter (a 500 from client
input is a bug). Before any of that, the body's nesting depth is bounded
(MESSAGES_MAX_JSON_DEPTH): orjson parses 1,024 levels but cannot encode past 254, and the worker
request re-encodes tool schemas and tool_use inputs.

Only the shape is checked here; what the gateway cannot serve (server tools, PDF documents, ...)
is refused by `convert.to_chat_request`, which knows why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from django.conf import settings

from messages_api.errors import InvalidRequest, RequestTooLarge

__all__ = ["validate_count_tokens_request", "validate_messages_request"]

ROLES = ("user", "assistant", "system")
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
THINKING_TYPES = ("enabled", "disabled", "adaptive")
MIN_THINKING_BUDGET = 1024

# Every content block tag the API (GA and beta) accepts in `messages[].content`, in the SDK's
# order. A tag outside this list is a client mistake (400 here); a tag inside it that the
# workers cannot take (server-tool results, container uploads, ...) is refused by the converter
# with a message saying so.
MESSAGE_BLOCK_TAGS = (
    "text",
    "image",
    "document",
    "search_result",
    "thinking",
    "redacted_thinking",
    "tool_use",
    "tool_result",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "container_upload",
    # beta only
    "mcp_tool_use",
    "mcp_tool_result",
    "mcp_tool_listing",
    "advisor_tool_result",
    "compaction",
    "fallback",
    "tool_addition",
    "tool_removal",
)
TOOL_RESULT_BLOCK_TAGS = ("text", "image", "document", "search_result", "tool_reference")
DOCUMENT_CONTENT_TAGS = ("text", "image")
IMAGE_SOURCE_TYPES = ("base64", "url", "file")
DOCUMENT_SOURCE_TYPES = ("base64", "text", "content", "url", "file")
# The media types each source type accepts (SDK: base64_image_source_param.py,
# base64_pdf_source_param.py, plain_text_source_param.py).
IMAGE_MEDIA_TYPES: dict[str, tuple[str, ...]] = {"base64": ("image/jpeg", "image/png", "image/gif", "image/webp")}
DOCUMENT_MEDIA_TYPES: dict[str, tuple[str, ...]] = {"base64": ("application/pdf",), "text": ("text/plain",)}
# The string fields each source type requires (SDK: *_source_param.py).
SOURCE_FIELDS: dict[str, tuple[str, ...]] = {
    "base64": ("media_type", "data"),
    "text": ("media_type", "data"),
    "url": ("url",),
    "file": ("file_id",),
}


def validate_messages_request(body: object) -> dict[str, Any]:
    """Check a `POST /v1/messages` body; return it unchanged (it is not copied)."""
    request = _object(body)
    max_tokens = _required(request, "max_tokens", "")
    if type(max_tokens) is not int:  # bool is an int subclass, and not a token count
        _fail("max_tokens", "Input should be a valid integer")
    if max_tokens < 1:
        _fail("max_tokens", "Input should be greater than or equal to 1")
    _validate_shared(request, max_tokens)
    return request


def validate_count_tokens_request(body: object) -> dict[str, Any]:
    """Check a `POST /v1/messages/count_tokens` body (no `max_tokens`); return it unchanged."""
    request = _object(body)
    _validate_shared(request, None)
    return request


# -- top level ------------------------------------------------------------------------------


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    _check_depth(body, settings.MESSAGES_MAX_JSON_DEPTH)
    _check_counts(body)
    return body


def _check_counts(body: dict[str, Any]) -> None:
    """Refuse more messages or content blocks (tool results' own blocks and system blocks
    included) than the settings allow: the work every later step does grows with them."""
    messages = body.get("messages")
    if type(messages) is not list:
        return
    if len(messages) > settings.MESSAGES_MAX_MESSAGES:
        _too_large(f"The request has {len(messages):,} messages; the limit is {settings.MESSAGES_MAX_MESSAGES:,}")
    system = body.get("system")
    blocks = len(system) if type(system) is list else 0
    for message in messages:
        content = message.get("content") if type(message) is dict else None
        if type(content) is list:
            blocks += len(content)
            for block in content:
                if type(block) is dict and type(block.get("content")) is list:
                    blocks += len(block["content"])
    if blocks > settings.MESSAGES_MAX_CONTENT_BLOCKS:
        _too_large(f"The request has {blocks:,} content blocks; the limit is {settings.MESSAGES_MAX_CONTENT_BLOCKS:,}")


def _too_large(message: str) -> NoReturn:
    raise RequestTooLarge(message)


def _check_depth(body: dict[str, Any], limit: int) -> None:
    """Refuse nesting deeper than `limit` (the body object is level 1), naming the top-level field.

    Iterative: a deep body must not exhaust the stack of the check meant to refuse it.
    """
    stack: list[tuple[Any, int, str]] = [
        (value, 2, key) for key, value in body.items() if type(value) is dict or type(value) is list
    ]
    while stack:
        value, depth, field = stack.pop()
        if depth > limit:
            _fail(field, f"JSON nested deeper than the limit of {limit} levels")
        for child in value.values() if type(value) is dict else value:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1, field))


def _validate_shared(request: dict[str, Any], max_tokens: int | None) -> None:
    model = _required(request, "model", "")
    if not isinstance(model, str):
        _fail("model", "Input should be a valid string")
    if not model:
        _fail("model", "String should have at least 1 character")
    _messages(_required(request, "messages", ""))
    for name, check in _OPTIONAL_FIELDS.items():
        value = request.get(name)
        if value is not None:
            check(value, name)
    thinking = request.get("thinking")
    if max_tokens is not None and thinking is not None and thinking["type"] == "enabled":
        if thinking["budget_tokens"] >= max_tokens:
            _fail_plain("`max_tokens` must be greater than `thinking.budget_tokens`")


# -- messages and blocks --------------------------------------------------------------------


def _messages(messages: object) -> None:
    if not isinstance(messages, list):
        _fail("messages", "Input should be a valid list")
    if not messages:
        _fail("messages", "at least one message is required")
    for i, message in enumerate(messages):
        path = f"messages.{i}"
        role = _required(_dict(message, path), "role", path)
        if role not in ROLES:
            _fail(f"{path}.role", "Input should be 'user', 'assistant' or 'system'")
        content = _required(message, "content", path)
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            _fail(f"{path}.content", "Input should be a valid string or a list of content blocks")
        tags = ("text",) if role == "system" else MESSAGE_BLOCK_TAGS
        for j, block in enumerate(content):
            _block(block, f"{path}.content.{j}", tags)


def _block(value: object, path: str, tags: tuple[str, ...]) -> None:
    if isinstance(value, dict) and not isinstance(value.get("type"), (str, type(None))):
        _fail(f"{path}.type", "Input should be a valid string")  # a block's tag, before it is looked up
    block, tag = _tagged(value, path, tags)
    check = _BLOCK_FIELDS.get(tag)
    if check is not None:
        check(block, path)


def _text_block(block: dict[str, Any], path: str) -> None:
    _string_field(block, "text", path)
    _optional_list(block, "citations", path)


def _image_block(block: dict[str, Any], path: str) -> None:
    _source(block, path, IMAGE_SOURCE_TYPES, IMAGE_MEDIA_TYPES)


def _document_block(block: dict[str, Any], path: str) -> None:
    source = _source(block, path, DOCUMENT_SOURCE_TYPES, DOCUMENT_MEDIA_TYPES)
    if source["type"] == "content":
        spath = f"{path}.source"
        content = _required(source, "content", spath)
        if not isinstance(content, str):
            if not isinstance(content, list):
                _fail(f"{spath}.content", "Input should be a valid string or a list of content blocks")
            for j, inner in enumerate(content):
                _block(inner, f"{spath}.content.{j}", DOCUMENT_CONTENT_TAGS)
    for name in ("title", "context"):
        _optional_string(block, name, path)


def _source(
    block: dict[str, Any], path: str, kinds: tuple[str, ...], media_types: dict[str, tuple[str, ...]]
) -> dict[str, Any]:
    """An image or document `source`: a tagged object with the string fields of its type, and a
    `media_type` among the API's own for the types that carry one."""
    spath = f"{path}.source"
    source, kind = _tagged(_required(block, "source", path), spath, kinds)
    for name in SOURCE_FIELDS.get(kind, ()):
        _string_field(source, name, spath)
    allowed = media_types.get(kind)
    if allowed is not None and source["media_type"] not in allowed:
        quoted = [f"'{m}'" for m in allowed]
        choices = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
        _fail(f"{spath}.media_type", f"Input should be {choices}")
    return source


def _tool_use_block(block: dict[str, Any], path: str) -> None:
    _string_field(block, "id", path)
    _string_field(block, "name", path)
    if not isinstance(_required(block, "input", path), dict):
        _fail(f"{path}.input", "Input should be a valid dictionary")


def _tool_result_block(block: dict[str, Any], path: str) -> None:
    _string_field(block, "tool_use_id", path)
    content = block.get("content")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list):
            _fail(f"{path}.content", "Input should be a valid string or a list of content blocks")
        for j, inner in enumerate(content):
            _block(inner, f"{path}.content.{j}", TOOL_RESULT_BLOCK_TAGS)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        _fail(f"{path}.is_error", "Input should be a valid boolean")


def _thinking_block(block: dict[str, Any], path: str) -> None:
    _string_field(block, "thinking", path)
    # Required by the API, where it proves the block came from Claude; the gateway's own thinking
    # blocks carry "" and open models cannot check one, so only its type is checked.
    _optional_string(block, "signature", path)


def _redacted_thinking_block(block: dict[str, Any], path: str) -> None:
    _string_field(block, "data", path)


def _search_result_block(block: dict[str, Any], path: str) -> None:
    content = _required(block, "content", path)
    if not isinstance(content, list):
        _fail(f"{path}.content", "Input should be a valid list")
    for j, inner in enumerate(content):
        _block(inner, f"{path}.content.{j}", ("text",))
    _string_field(block, "source", path)
    _string_field(block, "title", path)


_BLOCK_FIELDS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "text": _text_block,
    "image": _image_block,
    "document": _document_block,
    "tool_use": _tool_use_block,
    "tool_result": _tool_result_block,
    "thinking": _thinking_block,
    "redacted_thinking": _redacted_thinking_block,
    "search_result": _search_result_block,
}


# -- optional top-level fields --------------------------------------------------------------


def _system(value: object, path: str) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        _fail(path, "Input should be a valid string or a list of text blocks")
    for i, block in enumerate(value):
        _block(block, f"{path}.{i}", ("text",))


def _bool(value: object, path: str) -> None:
    if not isinstance(value, bool):
        _fail(path, "Input should be a valid boolean")


def _unit_interval(value: object, path: str) -> None:
    if type(value) not in (int, float):
        _fail(path, "Input should be a valid number")
    if value < 0:  # type: ignore[operator]
        _fail(path, "Input should be greater than or equal to 0")
    if value > 1:  # type: ignore[operator]
        _fail(path, "Input should be less than or equal to 1")


def _top_k(value: object, path: str) -> None:
    if type(value) is not int:
        _fail(path, "Input should be a valid integer")
    if value < 0:
        _fail(path, "Input should be greater than or equal to 0")


def _stop_sequences(value: object, path: str) -> None:
    if not isinstance(value, list):
        _fail(path, "Input should be a valid list")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            _fail(f"{path}.{i}", "Input should be a valid string")


def _tools(value: object, path: str) -> None:
    if not isinstance(value, list):
        _fail(path, "Input should be a valid list")
    for i, tool in enumerate(value):
        tpath = f"{path}.{i}"
        kind = _dict(tool, tpath).get("type")
        if kind is not None and not isinstance(kind, str):
            _fail(f"{tpath}.type", "Input should be a valid string")
        if kind is None or kind == "custom":
            _string_field(tool, "name", tpath)
            if not tool["name"]:
                _fail(f"{tpath}.name", "String should have at least 1 character")
            if not isinstance(_required(tool, "input_schema", tpath), dict):
                _fail(f"{tpath}.input_schema", "Input should be a valid dictionary")
        elif tool.get("name") is not None and not isinstance(tool["name"], str):
            # Typed (server or schema-less client) tools: the converter decides; toolsets carry no name.
            _fail(f"{tpath}.name", "Input should be a valid string")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            _fail(f"{tpath}.description", "Input should be a valid string")


def _tool_choice(value: object, path: str) -> None:
    choice, kind = _tagged(value, path, TOOL_CHOICE_TYPES)
    if kind == "tool":
        _string_field(choice, "name", path)
    flag = choice.get("disable_parallel_tool_use")
    if flag is not None:
        _bool(flag, f"{path}.disable_parallel_tool_use")


def _thinking(value: object, path: str) -> None:
    thinking, kind = _tagged(value, path, THINKING_TYPES)
    if kind == "enabled":
        budget = _required(thinking, "budget_tokens", path)
        if type(budget) is not int:
            _fail(f"{path}.budget_tokens", "Input should be a valid integer")
        if budget < MIN_THINKING_BUDGET:
            _fail(f"{path}.budget_tokens", f"Input should be greater than or equal to {MIN_THINKING_BUDGET}")


def _metadata(value: object, path: str) -> None:
    _optional_string(_dict(value, path), "user_id", path)


def _output_config(value: object, path: str) -> None:
    config = _dict(value, path)
    _optional_string(config, "effort", path)
    output_format = config.get("format")
    if output_format is not None:
        _json_schema_format(output_format, f"{path}.format")


def _json_schema_format(value: object, path: str) -> None:
    output_format, _ = _tagged(value, path, ("json_schema",))
    if not isinstance(_required(output_format, "schema", path), dict):
        _fail(f"{path}.schema", "Input should be a valid dictionary")


_OPTIONAL_FIELDS: dict[str, Callable[[Any, str], None]] = {
    "system": _system,
    "stream": _bool,
    "temperature": _unit_interval,
    "top_p": _unit_interval,
    "top_k": _top_k,
    "stop_sequences": _stop_sequences,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "thinking": _thinking,
    "metadata": _metadata,
    "output_config": _output_config,
    # the beta's older spelling of output_config.format
    "output_format": _json_schema_format,
}


# -- helpers --------------------------------------------------------------------------------


def _dict(value: object, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(path, "Input should be a valid dictionary")
    return value


def _tagged(value: object, path: str, tags: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    """A tagged object (a block, a source, a tool choice ...): a dictionary whose `type` is one of
    `tags`; it and its tag."""
    tagged = _dict(value, path)
    tag = _required(tagged, "type", path)
    if tag not in tags:
        _bad_tag(f"{path}.type", tag, tags)
    return tagged, tag


def _required(container: dict[str, Any], key: str, path: str) -> Any:
    value = container.get(key)
    if value is None:
        _fail(f"{path}.{key}" if path else key, "Field required")
    return value


def _string_field(container: dict[str, Any], key: str, path: str) -> None:
    if not isinstance(_required(container, key, path), str):
        _fail(f"{path}.{key}", "Input should be a valid string")


def _optional_string(container: dict[str, Any], key: str, path: str) -> None:
    value = container.get(key)
    if value is not None and not isinstance(value, str):
        _fail(f"{path}.{key}", "Input should be a valid string")


def _optional_list(container: dict[str, Any], key: str, path: str) -> None:
    value = container.get(key)
    if value is not None and not isinstance(value, list):
        _fail(f"{path}.{key}", "Input should be a valid list")


def _bad_tag(path: str, tag: object, expected: tuple[str, ...]) -> NoReturn:
    tags = ", ".join(f"'{t}'" for t in expected)
    _fail(path, f"Input tag '{tag}' found using 'type' does not match any of the expected tags: {tags}")


def _fail(path: str, message: str) -> NoReturn:
    raise InvalidRequest(f"{path}: {message}")


def _fail_plain(message: str) -> NoReturn:
    raise InvalidRequest(message)
