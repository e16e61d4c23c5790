"""Structured outputs in the OpenAI API: the fields that ask for an answer of a given
shape, read into one constraint ``(kind, spec)`` that the engine decodes under.

Spellings taken: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``)
and the Responses API's ``text.format``; vLLM's ``structured_outputs`` (``json``,
``regex``, ``choice``, ``json_object``) and its older ``guided_json``, ``guided_regex``,
``guided_choice``. Kinds: ``json_object`` (any JSON object), ``json_schema`` (a schema
dict), ``regex`` (a pattern string) and ``choice`` (a list of strings). Sizes are bounded
here (a 400 naming the field); whether the grammar engine can compile a spec is the
engine's answer, also a 400.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rtserve.errors import InvalidInput
from rtserve.runtime.llm.params import SamplingParams
from rtserve.server.tools import check_schema

JSON_OBJECT, JSON_SCHEMA, REGEX, CHOICE = "json_object", "json_schema", "regex", "choice"
MAX_SCHEMA_BYTES = 64 << 10
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
# Fields of a request body read here (removed before the sampling fields are read).
FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")
Constraint = tuple[str, Any]


def _fail(field: str, expected: str, value: Any) -> InvalidInput:
    return InvalidInput(f"{field}: expected {expected}, got {repr(value)[:80]}")


def _schema(value: Any, field: str) -> dict[str, Any]:
    if isinstance(value, str):  # (vLLM takes the schema as JSON text too)
        try:
            value = json.loads(value)
        except ValueError:
            raise _fail(field, "a JSON schema (an object, or its JSON text)", value) from None
    if not isinstance(value, dict):
        raise _fail(field, "a JSON schema (an object)", value)
    size = len(json.dumps(value))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidInput(
            f"{field}: a schema of {size} bytes, expected at most {MAX_SCHEMA_BYTES}"
        )
    check_schema(value, field)
    return value


def _regex(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_REGEX_CHARS:
        raise _fail(field, f"a regular expression of 1-{MAX_REGEX_CHARS} characters", value)
    return value


def _choices(value: Any, field: str) -> list[str]:
    if (
        not isinstance(value, list)
        or not value
        or len(value) > MAX_CHOICES
        or any(not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS for c in value)
    ):
        raise _fail(
            field,
            f"a list of 1-{MAX_CHOICES} non-empty strings of <= {MAX_CHOICE_CHARS} characters",
            value,
        )
    return list(value)


def response_format(value: Any, field: str = "response_format") -> Constraint | None:
    """OpenAI's ``response_format`` (chat) or the Responses API's ``text.format``
    (``{"type": "json_schema", "name", "schema", "strict"}`` flat)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return JSON_OBJECT, None
    if kind == JSON_SCHEMA:
        spec = value.get("json_schema", value)
        if not isinstance(spec, dict):
            raise _fail(f"{field}.json_schema", "an object with name and schema", spec)
        where = f"{field}.json_schema" if "json_schema" in value else field
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _fail(f"{where}.strict", "true or false", strict)
        if "schema" not in spec:  # (OpenAI's schema is optional: any JSON object then)
            return JSON_OBJECT, None
        return JSON_SCHEMA, _schema(spec["schema"], f"{where}.schema")
    raise _fail(field, '{"type": "text" | "json_object" | "json_schema", ...}', value)


def parse(doc: dict[str, Any]) -> Constraint | None:
    """The constraint a chat or completions body asks for (at most one spelling)."""
    found: list[tuple[str, Constraint]] = []
    value = response_format(doc.get("response_format"))
    if value is not None:
        found.append(("response_format", value))
    if doc.get("guided_json") is not None:
        found.append(("guided_json", (JSON_SCHEMA, _schema(doc["guided_json"], "guided_json"))))
    if doc.get("guided_regex") is not None:
        found.append(("guided_regex", (REGEX, _regex(doc["guided_regex"], "guided_regex"))))
    if doc.get("guided_choice") is not None:
        found.append(("guided_choice", (CHOICE, _choices(doc["guided_choice"], "guided_choice"))))
    so = doc.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _fail("structured_outputs", "an object such as {json: {...}}", so)
        for key in so:
            if key in ("json", "regex", "choice", "json_object") and so[key] not in (None, False):
                where = f"structured_outputs.{key}"
                if key == "json":
                    found.append((where, (JSON_SCHEMA, _schema(so[key], where))))
                elif key == "regex":
                    found.append((where, (REGEX, _regex(so[key], where))))
                elif key == "choice":
                    found.append((where, (CHOICE, _choices(so[key], where))))
                else:
                    found.append((where, (JSON_OBJECT, None)))
            elif so[key] is not None and key not in (
                "disable_any_whitespace",
                "whitespace_pattern",
            ):
                raise _fail(
                    f"structured_outputs.{key}",
                    "absent (rtserve takes json, regex, choice and json_object)",
                    so[key],
                )
    if len(found) > 1:
        raise InvalidInput(
            f"{found[1][0]}: expected one structured output request, but {found[0][0]} "
            "asks for one too"
        )
    return found[0][1] if found else None


def attach(params: SamplingParams, constraint: Constraint | None) -> SamplingParams:
    """``params`` decoding under ``constraint`` (the engine's ``llm.params.Constraint``)."""
    if constraint is None:
        return params
    from rtserve.runtime.llm import params as engine_params

    make = getattr(engine_params, "Constraint", None)
    if make is None or "constraint" not in {f.name for f in dataclasses.fields(params)}:
        raise InvalidInput("response_format: constrained decoding is not available in this build")
    kind, spec = constraint
    changes: dict[str, Any] = {"constraint": make(kind, spec)}
    return dataclasses.replace(params, **changes)
