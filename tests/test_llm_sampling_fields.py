"""The sampling fields people send besides temperature/top-p/top-k: bounded (errors name
the field) and applied per row: logit_bias, frequency/presence/repetition penalties, min_p
and min_tokens, greedy and sampled, on SmolLM2-135M and a random-weight Llama."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rtserve.errors import InvalidInput
from rtserve.runtime.llm.params import SamplingParams

SMOLLM2 = Path(__file__).resolve().parents[1] / "examples" / "llm-repository" / "smollm2" / "1"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("frequency_penalty", "1"),
        ("presence_penalty", -3),
        ("presence_penalty", float("nan")),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.1),
        ("min_p", 1.5),
        ("min_p", True),
        ("min_tokens", -1),
        ("min_tokens", 1.5),
        ("n", 0),
        ("n", 17),
        ("logit_bias", {"12": 101}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", [1, 2]),
        ("logit_bias", {str(i): 1 for i in range(301)}),
    ],
)
def test_fields_bounded_by_name(field: str, value: Any) -> None:
    with pytest.raises(InvalidInput, match=f"^{field}: expected "):
        SamplingParams.from_mapping({field: value})


def test_fields_read() -> None:
    p = SamplingParams.from_mapping(
        {
            "frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.2,
            "logit_bias": {"7": -100, "3": 5.5}, "min_p": 0.1, "min_tokens": 4, "n": 3,
        }
    )  # fmt: skip
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
    assert p.logit_bias == ((3, 5.5), (7, -100.0)) and p.min_p == 0.1
    assert p.min_tokens == 4 and p.n == 3 and p.changes_logits
    neutral = SamplingParams.from_mapping({"frequency_penalty": 0, "repetition_penalty": 1})
    assert not neutral.changes_logits


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rtserve.runtime.llm.engine import LlmEngine  # noqa: E402
from rtserve.runtime.llm.options import LlmOptions  # noqa: E402
from tests.llm_models import build_llm  # noqa: E402


def make(version_dir: Path, **options: object) -> LlmEngine:
    opts = {"device": "cpu", "kv_cache_bytes": 16 << 20, "max_model_len": 512, "threads": 1}
    opts.update(options)
    e = LlmEngine("m", "1", version_dir, LlmOptions.parse(opts, "test"))
    e.start()
    return e


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlmEngine]:
    e = make(build_llm(tmp_path_factory.mktemp("llm"), name="llama", arch="llama"))
    yield e
    asyncio.run(e.stop())


@pytest.fixture(scope="module")
def smol() -> Iterator[LlmEngine]:
    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip("needs `make examples` (SmolLM2-135M)")
    e = make(SMOLLM2, kv_cache_bytes=32 << 20)
    yield e
    asyncio.run(e.stop())


def gen(e: LlmEngine, ids: list[int], **kw: Any) -> tuple[list[int], str]:
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0.0)

    async def main() -> tuple[list[int], str]:
        tokens: list[int] = []
        reason = ""
        async for ev in e.generate(ids, SamplingParams(**kw)):
            tokens += ev.token_ids
            reason = ev.finish_reason or reason
        return tokens, reason

    return asyncio.run(main())


@pytest.mark.parametrize("model", ["tiny", "smol"])
def test_logit_bias_forces_and_bans(model: str, request: pytest.FixtureRequest) -> None:
    e: LlmEngine = request.getfixturevalue(model)
    ids = e.encode_text("The capital of France is")
    plain, _ = gen(e, ids)
    forced = 5 if plain[0] != 5 else 6
    tokens, _ = gen(e, ids, logit_bias=((forced, 100.0),), ignore_eos=True)
    assert tokens == [forced] * 12
    banned, _ = gen(e, ids, logit_bias=((plain[0], -100.0),))
    assert banned[0] != plain[0]
    sampled, _ = gen(e, ids, temperature=1.0, seed=1, logit_bias=((forced, 100.0),))
    assert sampled == [forced] * 12
    with pytest.raises(InvalidInput, match="^logit_bias: token id"):
        gen(e, ids, logit_bias=((e.runner.vocab_size, 1.0),))


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_penalties_cut_repetition(smol: LlmEngine) -> None:
    e = smol
    ids = e.encode_text("one two one two one two one two one two one two")
    plain, _ = gen(e, ids, max_tokens=24, ignore_eos=True)
    assert repeats(plain) > 6  # (greedy SmolLM2 goes on repeating)
    for field, value in [
        ("frequency_penalty", 2.0),
        ("presence_penalty", 2.0),
        ("repetition_penalty", 2.0),
    ]:
        tokens, _ = gen(e, ids, max_tokens=24, ignore_eos=True, **{field: value})
        assert tokens != plain and repeats(tokens) < repeats(plain), field
    # a negative presence penalty repeats more
    more, _ = gen(e, e.encode_text("Name three colors:"), max_tokens=24, ignore_eos=True,
                  presence_penalty=-2.0)  # fmt: skip
    fewer, _ = gen(e, e.encode_text("Name three colors:"), max_tokens=24, ignore_eos=True)
    assert repeats(more) >= repeats(fewer)


def test_min_tokens_holds_off_the_end(tiny: LlmEngine) -> None:
    e = tiny
    ids = e.encode_text("the cat")
    eos = sorted(e.runner.eos_ids)[0]
    ends_at_once, reason = gen(e, ids, logit_bias=((eos, 100.0),))
    assert reason == "stop" and len(ends_at_once) == 1
    held, reason = gen(e, ids, logit_bias=((eos, 100.0),), min_tokens=5)
    assert reason == "stop" and len(held) == 6 and eos not in held[:5]
    stop_id = held[0]  # (stop_token_ids are held off too)
    held2, _ = gen(e, ids, stop_token_ids=(stop_id,), min_tokens=3, logit_bias=((stop_id, 100.0),))
    assert stop_id not in held2[:3]


def test_min_p_one_is_greedy(smol: LlmEngine) -> None:
    e = smol
    ids = e.encode_text("Once upon a time")
    greedy, _ = gen(e, ids, max_tokens=16)
    for seed in (1, 2):
        sampled, _ = gen(e, ids, max_tokens=16, temperature=1.0, seed=seed, min_p=1.0)
        assert sampled == greedy
    loose = {tuple(gen(e, ids, max_tokens=16, temperature=1.5, seed=s)[0]) for s in (1, 2, 3)}
    assert len(loose) > 1  # (without min_p the same seeds wander)


def test_rows_without_fields_unchanged_beside_rows_with(tiny: LlmEngine) -> None:
    e = tiny
    ids = e.encode_text("the cat sat on the mat")

    async def both() -> list[list[int]]:
        async def one(p: SamplingParams) -> list[int]:
            return [t async for ev in e.generate(ids, p) for t in ev.token_ids]

        plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        biased = SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((9, 50.0),))
        return list(await asyncio.gather(one(plain), one(biased)))

    alone, _ = gen(e, ids, max_tokens=10, ignore_eos=True)
    beside, biased = asyncio.run(both())
    assert beside == alone and biased != alone
