"""Numbers under constrained decoding: a schema's open bounds closed (+-2^53-1, 6 decimals,
no exponent), so a random-weight model's greedy digits end and its JSON parses and matches
the schema it was given."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from rtserve.runtime.llm.engine import LlmEngine  # noqa: E402
from rtserve.runtime.llm.grammar import MAX_INTEGER, bounded_numbers  # noqa: E402
from rtserve.runtime.llm.options import LlmOptions  # noqa: E402
from rtserve.runtime.llm.params import Constraint, SamplingParams  # noqa: E402
from tests.llm_models import build_llm  # noqa: E402


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}  # fmt: skip


SCHEMAS = {
    "number": _object(x={"type": "number"}),
    "integer": _object(n={"type": "integer"}),
    "score": _object(score={"type": "number", "minimum": 0, "maximum": 1}),
    "list": _object(v={"type": "array", "items": {"type": "number"}, "maxItems": 3}),
    "nullable": _object(v={"type": ["number", "null"]},
                        w={"anyOf": [{"type": "integer", "minimum": 5}, {"enum": ["a"]}]}),
}  # fmt: skip


def test_open_bounds_are_closed_and_the_schema_s_own_kept() -> None:
    assert bounded_numbers({"type": "integer"}) == {
        "type": "integer", "minimum": -MAX_INTEGER, "maximum": MAX_INTEGER}  # fmt: skip
    number = bounded_numbers({"type": "number", "exclusiveMinimum": 0})
    assert number == {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_INTEGER,
                      "multipleOf": 1e-6}  # fmt: skip
    assert bounded_numbers({"type": "number", "multipleOf": 0.5})["multipleOf"] == 0.5
    fine = bounded_numbers({"type": "number", "minimum": 0, "maximum": 1e-9})
    assert "multipleOf" not in fine  # (6 decimals would leave only 0)
    literal = {"enum": [{"type": "integer"}], "const": {"type": "number"}, "default": 1}
    assert bounded_numbers(literal) == literal
    nested = bounded_numbers(SCHEMAS["nullable"])
    assert nested["properties"]["v"]["multipleOf"] == 1e-6
    assert nested["properties"]["w"]["anyOf"][0] == {
        "type": "integer", "minimum": 5, "maximum": MAX_INTEGER}  # fmt: skip
    assert bounded_numbers({"type": "string"}) == {"type": "string"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlmEngine]:
    version = build_llm(tmp_path_factory.mktemp("llm"), name="llama", arch="llama")
    options = {"device": "cpu", "kv_cache_bytes": 16 << 20, "max_model_len": 512, "threads": 1}
    engine = LlmEngine("m", "1", version, LlmOptions.parse(options, "test"))
    engine.start()
    yield engine
    asyncio.run(engine.stop())


async def _answer(e: LlmEngine, prompt: str, schema: dict[str, Any]) -> tuple[str, str | None]:
    params = SamplingParams(max_tokens=200, temperature=0.0,
                            constraint=Constraint("json_schema", schema))  # fmt: skip
    text, reason = "", None
    async for ev in e.generate(e.encode_text(prompt), params):
        text += ev.text
        if ev.finished:
            reason = ev.finish_reason
    return text, reason


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_random_weight_model_s_numbers_end_and_match_the_schema(
    tiny: LlmEngine, name: str
) -> None:
    schema = SCHEMAS[name]

    async def main() -> list[tuple[str, str | None]]:
        return list(await asyncio.gather(*(_answer(tiny, p, schema) for p in ("Rate: ", "x"))))

    for text, reason in asyncio.run(main()):
        assert reason == "stop", text  # (before: digits until max_tokens)
        doc = json.loads(text)
        jsonschema.validate(doc, schema)
        assert re.search(r"[0-9][eE]", text) is None  # (no exponent)
    assert tiny.pool.num_used == 0
