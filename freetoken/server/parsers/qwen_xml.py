"""Tool calls in the XML form of Qwen3-Coder and Qwen3.5 / Qwen3.6:

    Let me check.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The `<tool_call>` framing is Hermes' (hermes.py: whitespace around calls dropped, a call
reported when its closing tag arrives, a call left open at the end of the output counted when
its body is complete, a body that is not a call passed on as text, tags included). Only the
body differs: one `<function=NAME>` holding `<parameter=P>` blocks, each value the raw text
between the tags less the one newline that frames it on each side.

The XML carries no types, so the tools offered with the request (their JSON schemas) say what
a value is: a parameter declared number, integer, boolean, null, object or array whose text
is JSON of that type becomes that value; anything else (a string parameter, one the schema
does not describe, text that is not JSON of the declared type) stays the model's text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from freetoken.server.parsers.base import ToolCall
from freetoken.server.parsers.hermes import HermesToolParser

FUNCTION = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER = "<parameter="
PARAMETER_CLOSE = "</parameter>"

# {function name: {parameter name: its JSON schema}}
ToolSchemas = Mapping[str, Mapping[str, Any]]

_JSON_KINDS = ("number", "integer", "boolean", "null", "object", "array")


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The parameter schemas of the request's tools (OpenAI function tools, as the chat
    template takes them), by function name. A tool without properties has none."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        out[function["name"]] = dict(properties) if isinstance(properties, dict) else {}
    return out


def declared_kinds(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows: its `type` (one or a list), the types of
    its `anyOf` / `oneOf` members, else those of its `enum` values."""
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    kinds: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or ():
            kinds |= declared_kinds(member)
    if not kinds and isinstance(schema.get("enum"), list):
        kinds = {_kind_of(value) for value in schema["enum"]}
    return kinds


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")  # NaN and Infinity: json.loads takes them, JSON does not


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's value: JSON of a type its schema declares (other than string), else the text."""
    kinds = declared_kinds(schema)
    if "string" in kinds or not kinds & set(_JSON_KINDS):
        return text  # a string is always what the model wrote; no declared type: nothing to go by
    try:
        value = json.loads(text, parse_constant=_no_constants)
    except ValueError:
        return text
    kind = _kind_of(value)
    if kind in kinds or (kind == "integer" and "number" in kinds):
        return value
    if kind == "number" and "integer" in kinds and value.is_integer():
        return int(value)
    return text


def _name(text: str) -> str | None:
    """A function or parameter name as written between `=` and `>`; None when it cannot be one."""
    return text if text and not any(c.isspace() or c == "<" for c in text) else None


def _unframed(value: str) -> str:
    """A value without the newline the form puts after its open tag and before its close tag."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def read_xml_call(body: str, schemas: ToolSchemas) -> ToolCall | None:
    """The call a `<tool_call>` body holds, arguments typed by `schemas`; None when the body
    is not exactly one `<function=NAME>` of `<parameter=P>` blocks (each name once)."""
    rest = body.strip()
    if not rest.startswith(FUNCTION) or not rest.endswith(FUNCTION_CLOSE):
        return None
    head = rest.find(">")
    name = _name(rest[len(FUNCTION) : head])
    if name is None:
        return None
    rest = rest[head + 1 : len(rest) - len(FUNCTION_CLOSE)]
    properties = schemas.get(name, {})
    arguments: dict[str, Any] = {}
    while rest := rest.lstrip():
        if not rest.startswith(PARAMETER):
            return None
        head = rest.find(">")
        end = rest.find(PARAMETER_CLOSE, head + 1) if head >= 0 else -1
        parameter = _name(rest[len(PARAMETER) : head]) if end >= 0 else None
        if parameter is None or parameter in arguments:
            return None
        arguments[parameter] = typed_value(_unframed(rest[head + 1 : end]), properties.get(parameter))
        rest = rest[end + len(PARAMETER_CLOSE) :]
    return ToolCall(name, arguments)


class QwenXmlToolParser(HermesToolParser):
    def __init__(self, schemas: ToolSchemas | None = None) -> None:
        super().__init__()
        self._schemas: ToolSchemas = schemas or {}

    def read_call(self, body: str) -> ToolCall | None:
        return read_xml_call(body, self._schemas)
