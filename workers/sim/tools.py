"""Tool-call arguments the simulator "decides" on: built from the tool's own schema."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

STRING_VALUE = "Paris"
_BY_TYPE: dict[str, Any] = {
    "string": STRING_VALUE,
    "integer": 42,
    "number": 42,
    "boolean": True,
    "array": [],
    "object": {},
    "null": None,
}


def find_schema(tools: list[Any] | None, name: str) -> Mapping[str, Any] | None:
    """The parameter schema of the tool called `name`, in OpenAI or Anthropic form."""
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function")
        if isinstance(function, Mapping) and function.get("name") == name:
            schema = function.get("parameters")
        elif tool.get("name") == name:
            schema = tool.get("input_schema", tool.get("parameters"))
        else:
            continue
        return schema if isinstance(schema, Mapping) else {}
    return None


def _value_for(schema: Any) -> Any:
    if not isinstance(schema, Mapping):
        return STRING_VALUE
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    kind = schema.get("type")
    if isinstance(kind, list):  # ["string", "null"]: the first non-null type
        kind = next((k for k in kind if k != "null"), "null")
    return _BY_TYPE.get(kind, STRING_VALUE) if isinstance(kind, str) else STRING_VALUE


def arguments_for(schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """Each required property gets a value by its JSON type; `{}` for an unknown tool."""
    if not schema:
        return {}
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = schema.get("required")
    names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
    return {name: _value_for(properties.get(name)) for name in names}


def arguments_json(tools: list[Any] | None, name: str, *, invalid: bool = False) -> str:
    """The arguments string of a call to `name`; a truncated, unparseable one if `invalid`."""
    text = json.dumps(arguments_for(find_schema(tools, name)), ensure_ascii=False)
    if invalid:
        # Any strict prefix of a JSON object is unparseable: its closing brace is missing.
        return text[: max(1, len(text) - 4)]
    return text


def split_fragments(text: str, minimum: int = 3, size: int = 6) -> list[str]:
    """`text` in at least `minimum` non-empty pieces (fewer only if it is shorter than that)."""
    length = len(text)
    count = min(length, max(minimum, -(-length // size)))
    if count <= 1:
        return [text]
    return [text[length * i // count : length * (i + 1) // count] for i in range(count)]
