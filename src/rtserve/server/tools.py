"""Tools in the OpenAI API: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked
(``parse_tools``), the JSON schema that constrains decoding when a call is required
(``call_schema``), and the calls read back from the model's text (``parse_calls``, and
``CallStream`` while it streams).

The model writes a call in Hermes' form, ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (the default tool prompt of ``llm/chat.py`` asks for it; Qwen's and Hermes'
templates do too). With ``tool_choice`` ``required`` or a named function the answer is
decoded under ``call_schema``: a JSON list of ``{"name", "arguments"}`` objects whose
arguments match the function's parameters, so that any model returns a valid call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from rtserve.errors import InvalidInput

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_VALUES = ("enum", "const", "default", "examples")  # JSON values, not schemas


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """The tools a request offers and how the model may use them."""

    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}}, checked
    mode: str  # NONE | AUTO | REQUIRED | NAMED
    name: str | None = None  # NAMED: the function
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """Whether the answer is decoded under ``call_schema`` (a call is certain)."""
        return self.mode in (REQUIRED, NAMED)

    @property
    def offered(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows the model (None with ``tool_choice`` none)."""
        return None if self.mode == NONE else self.tools

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                params: dict[str, Any] = tool["function"].get("parameters") or {
                    "type": "object",
                    "properties": {},
                }
                return params
        raise KeyError(name)


def _fail(field: str, expected: str, value: Any) -> InvalidInput:
    return InvalidInput(f"{field}: expected {expected}, got {repr(value)[:60]}")


def _function(tool: Any, where: str) -> dict[str, Any]:
    """A tool as OpenAI's chat API spells it; the Responses API's flat form
    (``{"type": "function", "name", "parameters"}``) is taken too."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _fail(where, '{"type": "function", "function": {"name": ...}}', tool)
    function = tool.get("function", tool if "name" in tool else None)
    if not isinstance(function, dict):
        raise _fail(f"{where}.function", "an object with name and parameters", function)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _fail(f"{where}.function.name", "1-64 letters, digits, _ . or -", name)
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _fail(f"{where}.function.description", "a string", description)
    parameters = function.get("parameters")
    if parameters is not None and (
        not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
    ):
        raise _fail(f"{where}.function.parameters", "a JSON schema of type object", parameters)
    if parameters is not None:
        check_schema(parameters, f"{where}.function.parameters")
    out: dict[str, Any] = {"name": name}
    if description:
        out["description"] = description
    out["parameters"] = parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": out}


def parse_tools(doc: dict[str, Any]) -> ToolChoice | None:
    """The request's tools (None: it offers none); errors name the field."""
    tools = doc.get("tools")
    choice = doc.get("tool_choice")
    parallel = doc.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _fail("parallel_tool_calls", "true or false", parallel)
    if tools is None or tools == []:
        if choice not in (None, NONE):
            raise _fail("tool_choice", '"none" or absent when no tools are given', choice)
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _fail("tools", f"a list of at most {MAX_TOOLS} function tools", tools)
    checked = [_function(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise _fail("tools", "functions with distinct names", names)
    if choice is None:
        mode, name = AUTO, None
    elif choice in (NONE, AUTO, REQUIRED):
        mode, name = choice, None
    elif isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function", choice)
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise _fail("tool_choice.function.name", f"one of the tools: {names[:8]}", name)
        mode = NAMED
    else:
        raise _fail(
            "tool_choice",
            '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            choice,
        )
    return ToolChoice(checked, mode, name, parallel is not False)


_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_COUNTS = frozenset({
    "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
    "minContains", "maxContains",
})  # fmt: skip
_NUMBERS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_STRINGS = frozenset({"pattern", "format", "$ref", "$id", "$schema", "title", "description"})
_SCHEMAS = frozenset({
    "items", "additionalItems", "additionalProperties", "contains", "not", "if", "then",
    "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
})  # fmt: skip


def _keyword_error(key: str, value: Any) -> str | None:
    """What keyword ``key`` of a schema expects when ``value`` is not that (None: fine)."""
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if key == "type":
        names = value if isinstance(value, list) else [value]
        if not names or any(not isinstance(t, str) or t not in _TYPES for t in names):
            return f"one of {sorted(_TYPES)} or a non-empty list of them"
    elif key in _COUNTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return "an integer >= 0"
    elif key in _NUMBERS:
        if not number and not (key.startswith("exclusive") and isinstance(value, bool)):
            return "a number"
    elif key == "multipleOf":
        if not number or not value > 0:
            return "a number > 0"
    elif key == "required":
        if not isinstance(value, list) or any(not isinstance(k, str) for k in value):
            return "a list of property names (strings)"
    elif key == "enum":
        if not isinstance(value, list):
            return "a list of values"
    elif key == "uniqueItems":
        if not isinstance(value, bool):
            return "true or false"
    elif key in _STRINGS:
        if not isinstance(value, str):
            return "a string"
    elif key in _SCHEMA_MAPS or key == "dependentSchemas":
        if not isinstance(value, dict) or any(
            not isinstance(v, dict | bool) for v in value.values()
        ):
            return "an object of schemas"
    elif key in _SCHEMA_LISTS:
        if (
            not isinstance(value, list)
            or not value
            or any(not isinstance(v, dict | bool) for v in value)
        ):
            return "a non-empty list of schemas"
    elif key in _SCHEMAS:  # (items: a list of schemas too, draft 4's tuple form)
        kinds = (dict, bool, list) if key == "items" else (dict, bool)
        return None if isinstance(value, kinds) else "a schema (an object or a boolean)"
    return None


_Path = tuple[Any, str] | None  # (parent, segment): shared by siblings, built on failure


def _where(field: str, path: _Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, segment = path
        parts.append(segment)
    text = "".join(reversed(parts))
    return field + (text if len(text) <= 200 else "..." + text[-200:])


def check_schema(schema: Any, field: str) -> None:
    """InvalidInput naming ``field`` and the keyword when a keyword of the JSON schema has a
    value of the wrong kind (``{"minimum": "x"}``, ``{"maxLength": -1}``, ``{"required":
    "a"}``), which the grammar engine would ignore. Each subschema is visited once, without
    recursion: linear in the schema's size (bounded where it is read)."""
    stack: list[tuple[Any, _Path]] = [(schema, None)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise _fail(_where(field, path), "a schema (an object or a boolean)", node)
        for key, value in node.items():
            expected = _keyword_error(key, value)
            if expected is not None:
                raise _fail(_where(field, (path, f".{key}")), expected, value)
            if key in _SCHEMA_MAPS or key == "dependentSchemas":
                stack.extend((v, (path, f".{key}.{k}")) for k, v in value.items())
            elif key in _SCHEMA_LISTS or (key == "items" and isinstance(value, list)):
                stack.extend((v, (path, f".{key}[{i}]")) for i, v in enumerate(value))
            elif key in _SCHEMAS:
                stack.append((value, (path, f".{key}")))


def closed(schema: Any, depth: int = 0) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not say
    otherwise: a forced call holds the declared arguments only, so that a small model's
    answer ends (JSON Schema's default would let it add keys until ``max_tokens``)."""
    if depth > 64 or not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():  # each subschema visited once: linear in its size
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: closed(v, depth + 1) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [closed(v, depth + 1) for v in value]
        elif key not in _VALUES and isinstance(value, dict):
            out[key] = closed(value, depth + 1)
        else:
            out[key] = value
    if isinstance(out.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


def call_schema(choice: ToolChoice) -> dict[str, Any]:
    """The JSON schema of an answer that must call a tool: a list of ``{"name",
    "arguments"}`` (one item for a named function or without parallel calls)."""
    names: list[str] = [t["function"]["name"] for t in choice.tools]
    if choice.mode == NAMED and choice.name is not None:
        names = [choice.name]
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "arguments": closed(choice.parameters(name)),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name in names
    ]
    item = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not choice.parallel or choice.mode == NAMED:  # (a named function: one call of it)
        schema["maxItems"] = 1
    return schema


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    """One entry of ``message.tool_calls``."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def _call(found: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(found, dict):
        return None
    name = found.get("name")
    arguments = found.get("arguments", found.get("parameters", {}))
    if name not in names or not isinstance(arguments, dict | str):
        return None
    return new_call(name, arguments)


def parse_calls(text: str, choice: ToolChoice | None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole answer: under ``call_schema`` the JSON list; else
    the Hermes ``<tool_call>`` blocks (one the model did not close counts when its JSON is
    whole), the rest of the text the content. Text that does not parse stays content."""
    if choice is None or choice.mode == NONE:
        return text, []
    names = {t["function"]["name"] for t in choice.tools}
    if choice.constrained:
        try:
            found = json.loads(text)
        except ValueError:
            found = _whole_items(text)  # cut at max_tokens: the calls that are whole
        items = found if isinstance(found, list) else [found]
        calls = [c for c in (_call(item, names) for item in items) if c is not None]
        return (None, calls) if calls else (text, [])
    if _OPEN not in text:
        return text, []
    calls = []
    kept: list[str] = []
    start = 0
    for match in _CALL.finditer(text):
        try:
            call = _call(json.loads(match.group(1)), names)
        except ValueError:
            call = None
        if call is None:
            continue
        calls.append(call)
        kept.append(text[start : match.start()])
        start = match.end()
    kept.append(text[start:])
    content = "".join(kept).strip()
    if not calls:
        return text, []
    return content or None, calls


def _whole_items(text: str) -> list[Any]:
    """The complete items at the head of a JSON list that was cut short."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    if not text.lstrip().startswith("["):
        return items
    at = text.find("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\n\r,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)


class CallStream:
    """Streams an answer's content while holding back what may be a tool call: text from
    a ``<tool_call>`` tag on (or all of it, under ``call_schema``) is kept until the end,
    then read by ``parse_calls``."""

    def __init__(self, choice: ToolChoice | None) -> None:
        self.choice = choice
        self.active = choice is not None and choice.mode != NONE
        self.held = ""  # text not sent yet
        self.calling = choice is not None and choice.constrained

    def feed(self, text: str) -> str:
        """The part of ``text`` that can be sent as content now."""
        if not self.active:
            return text
        self.held += text
        if self.calling:
            return ""
        at = self.held.find(_OPEN)
        if at >= 0:
            self.calling = True
            out, self.held = self.held[:at], self.held[at:]
            return out
        keep = _partial_tag(self.held)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, tool calls) once the answer is whole."""
        held, self.held = self.held, ""
        if not self.active or not held:
            return held, []
        content, calls = parse_calls(held, self.choice)
        return content or "", calls


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0
