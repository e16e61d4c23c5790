"""Structured output in the engine: JSON schemas, JSON objects, regexes and choice lists
decoded under llguidance's token mask, on SmolLM2-135M and on a random-weight Llama; greedy
and sampled, streamed, through prefix caching, preemption and speculative decoding; bad and
pathological schemas refused by name without stalling other requests."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")

from rtserve.errors import InvalidInput  # noqa: E402
from rtserve.runtime.llm.engine import LlmEngine  # noqa: E402
from rtserve.runtime.llm.options import LlmOptions  # noqa: E402
from rtserve.runtime.llm.params import Constraint, SamplingParams  # noqa: E402
from tests.llm_models import build_llm  # noqa: E402

SMOLLM2 = Path(__file__).resolve().parents[1] / "examples" / "llm-repository" / "smollm2" / "1"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["x", "y"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["paris", "rome"]},
                "zip": {"type": "integer", "minimum": 1000, "maximum": 9999},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "pet": {
            "anyOf": [
                {"type": "boolean"},
                {
                    "type": "object",
                    "properties": {"kind": {"enum": ["cat", "dog"]}},
                    "required": ["kind"],
                    "additionalProperties": False,
                },
            ]
        },
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["name", "age", "code", "tags", "home", "pet"],
    "additionalProperties": False,
}


# (a number's digits are unbounded: a random-weight model can write them until max_tokens)
SCORE = {
    "type": "object",
    "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["score"],
}


def validate(doc: Any, schema: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, schema)


def make(version_dir: Path, **options: object) -> LlmEngine:
    opts = {"device": "cpu", "kv_cache_bytes": 16 << 20, "max_model_len": 512, "threads": 1}
    opts.update(options)
    e = LlmEngine("m", "1", version_dir, LlmOptions.parse(opts, "test"))
    e.start()
    return e


async def collect(e: LlmEngine, ids: list[int], params: SamplingParams) -> dict[int, Any]:
    """Each choice's (text, finish_reason, events)."""
    out: dict[int, list[Any]] = {}
    async for ev in e.generate(ids, params):
        entry = out.setdefault(ev.index, ["", None, 0])
        entry[0] += ev.text
        entry[2] += 1
        if ev.finished:
            entry[1] = ev.finish_reason
    return {k: tuple(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlmEngine]:
    e = make(build_llm(tmp_path_factory.mktemp("llm"), name="llama", arch="llama"))
    yield e
    asyncio.run(e.stop())


@pytest.fixture(scope="module")
def smol() -> Iterator[LlmEngine]:
    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip("needs `make examples` (SmolLM2-135M)")
    e = make(SMOLLM2, kv_cache_bytes=64 << 20, max_model_len=1024)
    yield e
    asyncio.run(e.stop())


def schema_params(schema: dict[str, Any], **kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 200)
    return SamplingParams(constraint=Constraint("json_schema", schema), **kw)


@pytest.mark.parametrize("model", ["tiny", "smol"])
def test_schema_outputs_parse_and_validate(model: str, request: pytest.FixtureRequest) -> None:
    e: LlmEngine = request.getfixturevalue(model)
    ids = e.encode_text("Describe a person as JSON: ")

    async def main() -> list[Any]:
        runs = [
            collect(e, ids, schema_params(PERSON, temperature=0.0)),
            collect(e, ids, schema_params(PERSON, temperature=1.0, seed=3, n=3)),
            collect(e, ids, schema_params(PERSON, temperature=0.7, top_p=0.9, seed=4)),
        ]
        return await asyncio.gather(*runs)

    results = asyncio.run(main())
    docs = [choice for r in results for choice in r.values()]
    assert len(docs) == 5
    for text, reason, events in docs:
        assert reason == "stop", text
        assert events > 1  # (streamed: the text comes over several events)
        doc = json.loads(text)
        validate(doc, PERSON)
        assert re.fullmatch("[A-Z]{2}[0-9]{2}", doc["code"])
    assert e.pool.num_used == 0


def test_streamed_json_object_regex_and_choice(smol: LlmEngine) -> None:
    e = smol
    ids = e.encode_text("Answer: ")

    async def main() -> list[Any]:
        return await asyncio.gather(
            collect(e, ids, SamplingParams(max_tokens=120, temperature=0.0,
                                           constraint=Constraint("json_object"))),
            collect(e, ids, SamplingParams(max_tokens=40, temperature=1.0, seed=1,
                                           constraint=Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"))),
            collect(e, ids, SamplingParams(max_tokens=40, temperature=0.0,
                                           constraint=Constraint("choice", ["red car", "blue"]))),
            collect(e, e.encode_text("Rate this from 0 to 1 as JSON: "),
                    schema_params(SCORE, temperature=0.0)),
        )  # fmt: skip

    obj, rx, choice, score = (r[0] for r in asyncio.run(main()))
    assert obj[1] == "stop" and isinstance(json.loads(obj[0]), dict)
    assert rx[1] == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", rx[0]), rx
    assert choice[1] == "stop" and choice[0] in ("red car", "blue")
    assert score[1] == "stop", score
    validate(json.loads(score[0]), SCORE)


def test_unconstrained_rows_beside_constrained_are_unchanged(tiny: LlmEngine) -> None:
    """A constrained row in the batch changes nothing for the others (greedy equals alone)."""
    e = tiny
    ids = e.encode_text("the cat sat on the mat")
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[Any, Any, Any]:
        alone = await collect(e, ids, plain)
        both = await asyncio.gather(collect(e, ids, plain), collect(e, ids, schema_params(PERSON)))
        return alone, both[0], both[1]

    alone, beside, constrained = asyncio.run(main())
    assert alone[0][0] == beside[0][0]
    validate(json.loads(constrained[0][0]), PERSON)


def test_bad_schema_refused_by_name(tiny: LlmEngine) -> None:
    e = tiny
    ids = e.encode_text("x")
    bad = [
        Constraint("json_schema", {"type": "object", "properties": {"a": {"type": "strin"}}}),
        Constraint("json_schema", {"$ref": "#/definitions/missing"}),
        Constraint("json_schema", "not a schema"),
        Constraint("regex", "(unclosed"),
        Constraint("choice", []),
        Constraint("yaml", None),
    ]

    async def main() -> None:
        for c in bad:
            with pytest.raises(InvalidInput, match="^response_format: "):
                await e.check_constraint(SamplingParams(constraint=c))
            with pytest.raises(InvalidInput, match="^response_format: "):
                await collect(e, ids, SamplingParams(constraint=c))

    asyncio.run(main())
    assert e.pool.num_used == 0 and not e.scheduler.running


def test_grammar_failing_while_generating_is_an_error_not_a_cut_answer(tiny: LlmEngine) -> None:
    """A schema with no finite instance compiles, then hits the parser's limits after a
    token or two: the request fails naming the field (not a cut JSON ending "stop"), its
    blocks are freed and the next request is served."""
    e = tiny
    ids = e.encode_text("x")
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}

    async def main() -> Any:
        with pytest.raises(InvalidInput, match="^response_format: the constraint failed after"):
            await collect(e, ids, schema_params(endless, temperature=0.0))
        return await collect(e, ids, SamplingParams(max_tokens=3, temperature=0.0))

    after = asyncio.run(main())
    assert after[0][1] == "length"
    assert e.pool.num_used == 0 and not e.scheduler.running


def test_compiled_once_and_cache_bounded(tiny: LlmEngine) -> None:
    e = tiny
    g = e.grammars
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}

    async def main() -> None:
        before = g.compiles
        for _ in range(3):
            await e.check_constraint(schema_params(schema))
        assert g.compiles == before + 1
        for i in range(g.cache_size + 5):
            await e.check_constraint(schema_params({"type": "string", "maxLength": i + 1}))
        assert len(g._cache) == g.cache_size

    asyncio.run(main())


def test_pathological_schemas_bounded_and_never_stall(tiny: LlmEngine) -> None:
    """A deeply nested schema and a huge enum: compiled (or refused) in bounded time off
    the event loop; a plain request finishes meanwhile."""
    e = tiny
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    huge = {"type": "string", "enum": [f"value-{i:05d}-{i * 7919 % 10007}" for i in range(20000)]}
    ids = e.encode_text("the cat")

    async def timed(c: Constraint) -> tuple[float, str]:
        t = time.perf_counter()
        try:
            await e.check_constraint(SamplingParams(constraint=c))
            outcome = "compiled"
        except InvalidInput as exc:
            assert str(exc).startswith("response_format: ")
            outcome = "refused"
        return time.perf_counter() - t, outcome

    async def main() -> list[Any]:
        other = collect(e, ids, SamplingParams(max_tokens=4, temperature=0.0))
        return await asyncio.gather(
            timed(Constraint("json_schema", deep)), timed(Constraint("json_schema", huge)), other
        )

    (t_deep, deep_out), (t_huge, huge_out), other = asyncio.run(main())
    print(f"deep nesting: {deep_out} in {t_deep:.2f} s; huge enum: {huge_out} in {t_huge:.2f} s")
    assert t_deep < e.grammars.timeout_s + 2 and t_huge < e.grammars.timeout_s + 2
    assert other[0][1] == "length"


def test_survives_preemption_and_prefix_cache(tmp_path: Path) -> None:
    """Many constrained sequences in a pool too small for all: preempted ones recompute and
    their grammar state carries on; a repeated prompt comes from the prefix cache."""
    e = make(
        build_llm(tmp_path, name="llama", arch="llama"),
        block_size=4, kv_cache_bytes=64 << 10, max_num_batched_tokens=64,
    )  # fmt: skip
    try:
        ids = e.encode_text("the cat sat on the mat")

        async def main() -> list[Any]:
            runs = [
                collect(e, ids, schema_params(PERSON, temperature=1.0, seed=i, max_tokens=110))
                for i in range(6)
            ]
            return await asyncio.gather(*runs)

        results = asyncio.run(main())
        for r in results:
            validate(json.loads(r[0][0]), PERSON)
        assert e.scheduler.preemptions > 0
        assert e.pool.num_used == 0
    finally:
        asyncio.run(e.stop())


def test_constrained_rows_skip_speculation(tmp_path: Path) -> None:
    lookup = {"method": "prompt_lookup", "num_tokens": 4, "max_batch": 64}
    e = make(build_llm(tmp_path, name="llama", arch="llama"), speculative=lookup)
    try:
        ids = e.encode_text('{"name":"ann","age":20} {"name":"ann","age":20} ')
        r = asyncio.run(collect(e, ids, schema_params(PERSON, temperature=0.0)))
        validate(json.loads(r[0][0]), PERSON)
        assert e.metrics.drafted == 0
    finally:
        asyncio.run(e.stop())
