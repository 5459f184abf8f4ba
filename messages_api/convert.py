"""Anthropic Messages request → OpenAI chat completions request, for the workers.

Reads as a table of contents: `to_chat_request` makes one call per concern (messages, sampling,
tools, thinking, output config, metadata), and `_user_turn` / `_assistant_turn` one call per
block type. The body must have passed `validation.validate_messages_request` (or the
count_tokens twin: without `max_tokens` none is set), so required fields are indexed directly.

What the workers cannot take is refused with a 400 naming the path instead of being dropped:
a silently dropped block changes what the model is asked without the client learning of it.
The exceptions are `redacted_thinking` (opaque, cannot be replayed to an open model, and
Claude Code sends it back on every turn) and Claude Code's billing block (below).
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

import orjson

from messages_api.errors import InvalidRequest

__all__ = ["to_chat_request"]

# Claude Code puts a per-request attribution block first in `system`
# ("x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli; cch=...;"). It is client
# telemetry, not an instruction, and because it changes per request it sits in front of every
# cached prefix on the workers. Matched by shape (marker, then `key=value;` pairs) rather than by
# a field list, which drifts between Claude Code versions.
BILLING_BLOCK = re.compile(r"x-anthropic-billing-header:\s*(?:[A-Za-z_][\w.-]*=[^;]*;\s*)+")

# Anthropic's effort levels that have no OpenAI `reasoning_effort` twin map to the highest one.
REASONING_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}

# Tools Anthropic runs on its own servers: nothing here can execute them.
SERVER_TOOL_PREFIXES = ("web_search", "web_fetch", "code_execution", "mcp_toolset", "tool_search_tool", "advisor")

# Anthropic-only tool fields that never reach a worker: cache_control, strict, defer_loading,
# input_examples, eager_input_streaming, type "custom". (`strict` is dropped too: it asks for
# grammar-constrained arguments, which the workers' tool parsers do not promise.)

TEXT_JOIN = "\n\n"


def to_chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """A validated Anthropic body → an OpenAI chat request, without `stream`/`stream_options`."""
    chat: dict[str, Any] = {"model": body["model"], "messages": _messages(body)}
    max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        # Only `max_tokens`: TRT-LLM aliases `max_completion_tokens` to it under extra="forbid",
        # so a body carrying both is rejected; vLLM reads either.
        chat["max_tokens"] = max_tokens
    _sampling(body, chat)
    _tools(body, chat)
    _thinking(body, chat)
    _output_config(body, chat)
    _metadata(body, chat)
    return chat


# -- request-level fields -------------------------------------------------------------------


def _sampling(body: dict[str, Any], chat: dict[str, Any]) -> None:
    for name in ("temperature", "top_p", "top_k"):
        value = body.get(name)
        if value is not None:
            chat[name] = value
    # An empty stop string would end every generation at once (or be rejected by the worker).
    stop = [s for s in body.get("stop_sequences") or () if s]
    if stop:
        chat["stop"] = stop


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = [_tool(tool, f"tools.{i}") for i, tool in enumerate(body.get("tools") or ())]
    choice = body.get("tool_choice")
    if tools:
        chat["tools"] = tools
    if choice is None:
        return
    kind = choice["type"]
    if not tools:
        # OpenAI servers reject a tool_choice without tools; without tools, auto and none are moot.
        if kind in ("any", "tool"):
            _fail("tool_choice", f"tool_choice type '{kind}' requires at least one tool in `tools`")
        return
    if kind == "tool":
        name = choice["name"]
        if not any(tool["function"]["name"] == name for tool in tools):
            _fail("tool_choice.name", f"tool '{name}' is not among the request's tools")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        # "none" forbids calling tools, not knowing them: the definitions stay in the prompt so
        # the rendered prefix (and the workers' KV cache) does not change between turns.
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _tool(tool: dict[str, Any], path: str) -> dict[str, Any]:
    kind = tool.get("type")
    if kind is not None and kind != "custom":
        if kind.startswith(SERVER_TOOL_PREFIXES):
            _fail(
                path,
                f"'{kind}' is a server tool, which Anthropic runs on its own servers; "
                "it is not available through this gateway",
            )
        if not isinstance(tool.get("input_schema"), dict):
            # bash_*, text_editor_*, computer_*, memory_*, browser toolsets: Anthropic supplies
            # their schemas, which an open model has never seen.
            _fail(
                path,
                f"tool type '{kind}' is not supported by this gateway; "
                "define it as a custom tool with an input_schema",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            _fail(f"{path}.name", "Field required")
    function: dict[str, Any] = {"name": tool["name"]}
    description = tool.get("description")
    if description is not None:
        function["description"] = description
    function["parameters"] = tool["input_schema"]
    return {"type": "function", "function": function}


def _thinking(body: dict[str, Any], chat: dict[str, Any]) -> None:
    thinking = body.get("thinking")
    if thinking is None:
        return
    kind = thinking["type"]
    # Qwen3-style chat templates (and GLM's) read `enable_thinking`, through vLLM and TRT-LLM alike.
    chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    if kind == "enabled":
        chat["thinking_token_budget"] = thinking["budget_tokens"]


def _output_config(body: dict[str, Any], chat: dict[str, Any]) -> None:
    config = body.get("output_config") or {}
    effort = REASONING_EFFORT.get(config.get("effort"))  # type: ignore[arg-type]
    if effort is not None:
        chat["reasoning_effort"] = effort
    # `output_format` is the structured-outputs beta's earlier spelling of output_config.format.
    output_format = config.get("format") or body.get("output_format")
    if output_format is not None:
        # vLLM requires a `name`; TRT-LLM reads only `schema`.
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": output_format["schema"]},
        }


def _metadata(body: dict[str, Any], chat: dict[str, Any]) -> None:
    user_id = (body.get("metadata") or {}).get("user_id")
    if user_id:
        chat["user"] = user_id


# -- messages -------------------------------------------------------------------------------


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _system_texts(body.get("system"))
    messages: list[dict[str, Any]] = body["messages"]
    # System messages before the first real turn join the opening system prompt (most chat
    # templates accept a system message only at position 0). Later ones stay where the client
    # put them: hoisting a tail reminder to the front would rewrite the start of the prompt and
    # throw away the workers' whole cached prefix.
    first = 0
    while first < len(messages) and messages[first]["role"] == "system":
        text = _system_message_text(messages[first])
        if text:
            system.append(text)
        first += 1
    if system:
        out.append({"role": "system", "content": TEXT_JOIN.join(system)})
    for i in range(first, len(messages)):
        message = messages[i]
        role = message["role"]
        if role == "user":
            _user_turn(message["content"], f"messages.{i}", out)
        elif role == "assistant":
            _assistant_turn(message["content"], f"messages.{i}", out)
        else:
            out.append({"role": "system", "content": _system_message_text(message)})
    return out


def _system_texts(system: str | list[dict[str, Any]] | None) -> list[str]:
    if system is None:
        return []
    if isinstance(system, str):
        return [system] if system else []
    texts = []
    for i, block in enumerate(system):
        text = block["text"]
        # Only in first position, where Claude Code puts it: a user's own block that happens to
        # look like one further down is left alone.
        if i == 0 and BILLING_BLOCK.fullmatch(text):
            continue
        if text:
            texts.append(text)
    return texts


def _system_message_text(message: dict[str, Any]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return TEXT_JOIN.join(block["text"] for block in content if block["text"])


def _user_turn(content: str | list[dict[str, Any]], path: str, out: list[dict[str, Any]]) -> None:
    if isinstance(content, str):
        _append_user(out, content)
        return
    # OpenAI wants every tool message right after the assistant message that made the calls,
    # so a turn's tool results go first, in block order; the rest of the turn follows as one
    # user message. Images from tool results (a tool message holds only text) lead it.
    tool_images: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    had_tool_result = False
    for j, block in enumerate(content):
        kind = block["type"]
        bpath = f"{path}.content.{j}"
        if kind == "tool_result":
            had_tool_result = True
            out.append(_tool_message(block, bpath, tool_images))
        elif kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block, bpath))
        elif kind == "document":
            parts.extend(_document_parts(block, bpath))
        elif kind == "search_result":
            parts.append({"type": "text", "text": _search_result_text(block)})
        elif kind in ("thinking", "redacted_thinking", "tool_use"):
            _fail(bpath, f"'{kind}' blocks are only valid in assistant messages")
        else:
            _unsupported(kind, bpath)
    parts = tool_images + parts if tool_images else parts
    if parts or not had_tool_result:
        _append_user(out, _content(parts))


def _append_user(out: list[dict[str, Any]], content: str | list[dict[str, Any]]) -> None:
    """Add a user message, merged into a user message right before it.

    The API combines consecutive same-role turns; many chat templates (Mistral, Gemma, ...)
    instead reject two user messages in a row.
    """
    last = out[-1] if out else None
    if last is None or last["role"] != "user":
        out.append({"role": "user", "content": content})
    elif isinstance(last["content"], str) and isinstance(content, str):
        last["content"] = TEXT_JOIN.join(s for s in (last["content"], content) if s)
    else:
        last["content"] = _as_parts(last["content"]) + _as_parts(content)


def _as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []


def _assistant_turn(content: str | list[dict[str, Any]], path: str, out: list[dict[str, Any]]) -> None:
    if isinstance(content, str):
        out.append({"role": "assistant", "content": content})
        return
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block["type"]
        if kind == "text":
            if block["text"]:
                texts.append(block["text"])
        elif kind == "thinking":
            # The worker's template decides whether past reasoning is rendered; it must never
            # leak into `content`, where the model would read it as something it said.
            if block["thinking"]:
                reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            pass  # encrypted by Anthropic: nothing an open model can read
        elif kind == "tool_use":
            tool_calls.append(_tool_call(block))
        elif kind in ("tool_result", "image", "document", "search_result"):
            _fail(f"{path}.content.{j}", f"'{kind}' blocks are not supported in assistant messages")
        else:
            _unsupported(kind, f"{path}.content.{j}")
    message: dict[str, Any] = {"role": "assistant", "content": TEXT_JOIN.join(texts)}
    if reasoning:
        message["reasoning_content"] = TEXT_JOIN.join(reasoning)
    if tool_calls:
        message["tool_calls"] = tool_calls
    out.append(message)


# -- blocks ---------------------------------------------------------------------------------


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A plain string unless an image needs OpenAI's list-of-parts form."""
    for part in parts:
        if part["type"] != "text":
            return parts
    return TEXT_JOIN.join(part["text"] for part in parts)


def _tool_call(block: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": orjson.dumps(block["input"]).decode()},
    }


def _tool_message(block: dict[str, Any], path: str, images: list[dict[str, Any]]) -> dict[str, Any]:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for j, inner in enumerate(content):
            kind = inner["type"]
            ipath = f"{path}.content.{j}"
            if kind == "text":
                texts.append(inner["text"])
            elif kind == "image":
                images.append(_image_part(inner, ipath))
            elif kind == "document":
                for part in _document_parts(inner, ipath):
                    if part["type"] == "text":
                        texts.append(part["text"])
                    else:
                        images.append(part)
            elif kind == "search_result":
                texts.append(_search_result_text(inner))
            else:
                _unsupported(kind, ipath)
        text = TEXT_JOIN.join(texts)
    if block.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _image_part(block: dict[str, Any], path: str) -> dict[str, Any]:
    source = block["source"]
    kind = source["type"]
    if kind == "url":
        # The workers would fetch it (vLLM and SGLang do by default): any key holder could make
        # the cluster reach internal addresses (169.254.169.254, file:, internal host names).
        _fail(
            path,
            "image blocks with a url source are not accepted by this gateway (its workers would fetch the URL); "
            "send the image as base64 data instead",
        )
    if kind != "base64":
        _fail(
            path,
            f"image blocks with a {kind} source are not supported by this gateway's workers; send base64 data instead",
        )
    return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}


def _document_parts(block: dict[str, Any], path: str) -> list[dict[str, Any]]:
    source = block["source"]
    kind = source["type"]
    if kind == "text":
        parts: list[dict[str, Any]] = [{"type": "text", "text": source.get("data") or ""}]
    elif kind == "content":
        inner = source.get("content")
        if isinstance(inner, str):
            parts = [{"type": "text", "text": inner}]
        else:
            parts = []
            for j, item in enumerate(inner or ()):
                item_kind = item.get("type") if isinstance(item, dict) else None
                if item_kind == "text":
                    parts.append({"type": "text", "text": item.get("text") or ""})
                elif item_kind == "image":
                    parts.append(_image_part(item, f"{path}.source.content.{j}"))
                else:
                    _unsupported(str(item_kind), f"{path}.source.content.{j}")
    else:
        # base64 (PDF), url, file: the workers have no PDF renderer or fetcher.
        _fail(
            path,
            f"document blocks with a {kind} source are not supported by this gateway's workers; "
            "send the text instead",
        )
    # The title and context are meant for the model, so they lead the document's text.
    preamble = [s for s in (block.get("title"), block.get("context")) if isinstance(s, str) and s]
    if preamble:
        if parts and parts[0]["type"] == "text":
            parts[0] = {"type": "text", "text": TEXT_JOIN.join([*preamble, parts[0]["text"]])}
        else:
            parts.insert(0, {"type": "text", "text": TEXT_JOIN.join(preamble)})
    return parts


def _search_result_text(block: dict[str, Any]) -> str:
    return TEXT_JOIN.join(item["text"] for item in block["content"])


# -- errors ---------------------------------------------------------------------------------


def _unsupported(kind: str, path: str) -> NoReturn:
    _fail(path, f"content block type '{kind}' is not supported by this gateway")


def _fail(path: str, message: str) -> NoReturn:
    raise InvalidRequest(f"{path}: {message}")
