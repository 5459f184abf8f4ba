"""What a worker's OpenAI chat answer must look like before the gateway reads it: pure checks.

    chunk = check_chunk(orjson.loads(event.data))        # a streamed chat.completion.chunk
    completion = check_completion(orjson.loads(body))    # a non-streamed chat.completion

Each returns its argument, typed, or raises `ShapeError` naming the first field that is wrong
("choices[0].delta.content is not a string"). They check the fields the gateway reads, as the
engines document them (OpenAI's chat API; vLLM, SGLang and TensorRT-LLM follow it): `choices` a
list of objects with an int `index`; `delta` / `message` an object; `content`,
`reasoning_content`, `reasoning` a string or null; `tool_calls` a list of
`{index, id, type, function: {name, arguments}}` with string-or-null leaves; `finish_reason` a
string or null; `usage` an object whose counts are non-negative ints. Any other field, such as
vLLM's `token_ids`, `prompt_token_ids` and `kv_transfer_params`, TensorRT-LLM's
`disaggregated_params`, `stop_reason` or SGLang's `matched_stop`, is the engine's business and
passes through untouched.

A streamed choice without a `delta` object is wrong unless it carries the `finish_reason`:
a chunk that says nothing would otherwise end an answer as if it had succeeded.
"""

from __future__ import annotations

from typing import Any

# Text fields of a delta or a message.
_TEXT_FIELDS = frozenset(("content", "reasoning_content", "reasoning", "role", "refusal"))
_USAGE_COUNTS = frozenset(("prompt_tokens", "completion_tokens", "total_tokens"))
_DETAIL_COUNTS = {"prompt_tokens_details": ("cached_tokens",), "completion_tokens_details": ("reasoning_tokens",)}


class ShapeError(ValueError):
    """A worker answer does not have the documented shape; `where` names the field."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where} {problem}" if where else problem)
        self.where = where
        self.problem = problem


def check_chunk(chunk: Any) -> dict[str, Any]:
    """A `chat.completion.chunk`: a usage-only chunk has `"choices": []` (or none)."""
    return _checked(chunk, "the chunk", "delta", streamed=True)


def check_completion(completion: Any) -> dict[str, Any]:
    """A non-streamed `chat.completion`: at least one choice, each with a `message` object."""
    return _checked(completion, "the answer", "message", streamed=False)


def _checked(answer: Any, what: str, body_name: str, *, streamed: bool) -> dict[str, Any]:
    """Both shapes' checks in one function: a chunk is checked per relayed token, and under load
    every Python call on that path costs (see workers.wire.connection). So the choices and the
    usage are checked inline, and the field's name for the error is only built to raise it."""
    if not isinstance(answer, dict):
        raise ShapeError(what, "is not an object")
    choices = answer.get("choices")
    if choices is not None or not streamed:
        if not isinstance(choices, list):
            raise ShapeError("choices", "is not a list")
        if not streamed and not choices:
            raise ShapeError("choices", "is empty")
        for i, choice in enumerate(choices):
            if not isinstance(choice, dict):
                raise ShapeError(f"choices[{i}]", "is not an object")
            index = choice.get("index")
            if index is not None and not (type(index) is int and index >= 0):  # _is_count, inline
                raise ShapeError(f"choices[{i}].index", "is not a non-negative integer")
            finish_reason = choice.get("finish_reason")
            if finish_reason is not None and not isinstance(finish_reason, str):
                raise ShapeError(f"choices[{i}].finish_reason", "is not a string")
            body = choice.get(body_name)
            if body is None:
                if streamed and finish_reason is not None:
                    continue  # a last chunk may carry only the finish reason
                raise ShapeError(f"choices[{i}].{body_name}", "is missing or null")
            if not isinstance(body, dict):
                raise ShapeError(f"choices[{i}].{body_name}", "is not an object")
            # Over the fields present (a delta has one or two), not over every field checked.
            for field, value in body.items():
                if value is None:
                    continue
                if field in _TEXT_FIELDS:
                    if type(value) is not str:
                        raise ShapeError(f"choices[{i}].{body_name}.{field}", "is not a string")
                elif field == "tool_calls":
                    _check_tool_calls(value, f"choices[{i}].{body_name}.tool_calls", streamed=streamed)
    usage = answer.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            raise ShapeError("usage", "is not an object")
        for field, value in usage.items():
            if value is None:
                continue
            if field in _USAGE_COUNTS:
                if not (type(value) is int and value >= 0):  # _is_count, inline
                    raise ShapeError(f"usage.{field}", "is not a non-negative integer")
            elif field in _DETAIL_COUNTS:
                _check_usage_details(value, field)
    return answer


def _check_tool_calls(tool_calls: Any, where: str, *, streamed: bool) -> None:
    if not isinstance(tool_calls, list):
        raise ShapeError(where, "is not a list")
    for i, call in enumerate(tool_calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise ShapeError(at, "is not an object")
        index = call.get("index")
        if index is None and streamed:
            raise ShapeError(f"{at}.index", "is missing")
        if index is not None and not _is_count(index):
            raise ShapeError(f"{at}.index", "is not a non-negative integer")
        for field in ("id", "type"):
            value = call.get(field)
            if value is not None and not isinstance(value, str):
                raise ShapeError(f"{at}.{field}", "is not a string")
        function = call.get("function")
        if function is None:
            continue  # a later delta of a call may carry nothing new
        if not isinstance(function, dict):
            raise ShapeError(f"{at}.function", "is not an object")
        for field in ("name", "arguments"):
            value = function.get(field)
            if value is not None and not isinstance(value, str):
                raise ShapeError(f"{at}.function.{field}", "is not a string")


def _check_usage_details(details: Any, field: str) -> None:
    if not isinstance(details, dict):
        raise ShapeError(f"usage.{field}", "is not an object")
    for count in _DETAIL_COUNTS[field]:
        detail = details.get(count)
        if detail is not None and not _is_count(detail):
            raise ShapeError(f"usage.{field}.{count}", "is not a non-negative integer")


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0  # bool is an int subclass, and never a count


__all__ = ["check_chunk", "check_completion", "ShapeError"]
