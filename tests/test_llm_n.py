"""``n`` > 1: several choices of one request from one ``generate``, the prompt computed
once and its KV blocks shared by the choices (forked after the prefill), each choice its
own sampling stream (``seed + index``), events identified by ``index``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from rtserve.errors import InvalidInput  # noqa: E402
from rtserve.runtime.llm.detok import Detokenizer  # noqa: E402
from rtserve.runtime.llm.engine import LlmEngine  # noqa: E402
from rtserve.runtime.llm.kv import BlockPool  # noqa: E402
from rtserve.runtime.llm.options import LlmOptions  # noqa: E402
from rtserve.runtime.llm.params import SamplingParams  # noqa: E402
from rtserve.runtime.llm.scheduler import Scheduler, Sequence, Step  # noqa: E402
from tests.llm_models import build_llm  # noqa: E402


def make(version_dir: Path, **options: object) -> LlmEngine:
    opts = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 512, "threads": 1}
    opts.update(options)
    e = LlmEngine("m", "1", version_dir, LlmOptions.parse(opts, "test"))
    e.start()
    return e


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlmEngine]:
    e = make(build_llm(tmp_path_factory.mktemp("llm"), name="llama", arch="llama"), block_size=8,
             kv_cache_bytes=2 << 20)  # fmt: skip
    yield e
    asyncio.run(e.stop())


def choices(e: LlmEngine, ids: list[int], params: SamplingParams) -> dict[int, Any]:
    """index -> (tokens, text, finish_reason, events, completion_tokens, prompt_tokens)."""

    async def main() -> dict[int, Any]:
        out: dict[int, list[Any]] = {}
        async for ev in e.generate(ids, params):
            c = out.setdefault(ev.index, [[], "", None, 0, 0, 0])
            assert c[2] is None  # (nothing after a choice's finished event)
            c[0] += ev.token_ids
            c[1] += ev.text
            c[3] += 1
            if ev.finished:
                c[2], c[4], c[5] = ev.finish_reason, ev.completion_tokens, ev.prompt_tokens
        return {k: tuple(v) for k, v in out.items()}

    return asyncio.run(main())


def test_greedy_choices_equal_one(tiny: LlmEngine) -> None:
    e = tiny
    ids = e.encode_text("the cat sat on the mat while rain fell")
    one = choices(e, ids, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    many = choices(e, ids, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=4))
    assert sorted(many) == [0, 1, 2, 3]
    for c in many.values():
        assert c[0] == one[0][0] and c[2] == "length"
        assert c[4] == 10 and c[5] == len(ids)
    assert e.pool.num_used == 0 and not e.scheduler.running


def test_seeded_choices_reproducible_and_distinct(tiny: LlmEngine) -> None:
    e = tiny
    ids = e.encode_text("the cat")
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=11, n=4, ignore_eos=True)
    first = choices(e, ids, params)
    again = choices(e, ids, params)
    assert {k: v[0] for k, v in first.items()} == {k: v[0] for k, v in again.items()}
    assert len({tuple(v[0]) for v in first.values()}) > 1  # (each its own stream)
    # choice i is what n=1 with seed + i gives
    for i in (0, 2):
        solo = choices(e, ids, SamplingParams(max_tokens=12, temperature=1.5, seed=11 + i,
                                              ignore_eos=True))  # fmt: skip
        assert solo[0][0] == first[i][0]
    assert e.pool.num_used == 0


def test_prompt_computed_once(tmp_path: Path) -> None:
    """A long prompt, n=4, no prefix cache: the prompt's tokens are computed about once
    (each other choice recomputes at most its last, partial block)."""
    e = make(build_llm(tmp_path, name="llama", arch="llama"), block_size=8,
             prefix_caching=False)  # fmt: skip
    try:
        ids = e.encode_text("the cat sat on the mat while rain fell outside " * 8)
        assert len(ids) > 60
        e.step_model.clear()
        out = choices(e, ids, SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=4,
                                             ignore_eos=True))  # fmt: skip
        assert all(c[2] == "length" and len(c[0]) == 6 for c in out.values())
        prefill = sum(p for _, p, _ in e.step_model._rows)
        assert prefill < len(ids) + 3 * 8, prefill  # (n separate prompts: 4 x len(ids))
        assert e.pool.num_used == 0
    finally:
        asyncio.run(e.stop())


def test_fork_shares_blocks() -> None:
    pool = BlockPool(32, 4, prefix_caching=True)
    sched = Scheduler(pool, 8, 64)
    params = SamplingParams(max_tokens=4)

    def seq() -> Sequence:
        return Sequence(list(range(10)), 10, params, 14, Detokenizer(None, ()))

    parent, child = seq(), seq()
    sched.add(parent)
    step = sched.schedule()
    assert step.items == [(parent, 10)]
    sched.after_step(Step(step.items, 0, 10))
    used = pool.num_used
    sched.fork(parent, child)
    assert child.blocks == parent.blocks[:2] and child.computed == 8
    assert all(pool.blocks[b].refs == 2 for b in child.blocks)
    assert pool.num_used == used  # (no new block for what is shared)
    parent.tokens.append(1)
    child.tokens.append(2)
    step = sched.schedule()
    assert dict((s.id, n) for s, n in step.items) == {parent.id: 1, child.id: 3}
    sched.after_step(step)
    assert child.blocks[:2] == parent.blocks[:2] and child.blocks[2] != parent.blocks[2]
    sched.finish(parent)
    assert all(pool.blocks[b].refs == 1 for b in child.blocks)
    sched.finish(child)
    assert pool.num_used == 0


def test_abort_frees_every_choice(tiny: LlmEngine) -> None:
    e = tiny
    ids = e.encode_text("the cat sat")

    async def main() -> int:
        seen = 0
        agen = e.generate(ids, SamplingParams(max_tokens=200, temperature=1.0, n=3,
                                              ignore_eos=True))  # fmt: skip
        async for ev in agen:
            seen += len(ev.token_ids)
            if seen >= 6:
                break
        await agen.aclose()
        for _ in range(200):
            if not e.scheduler.running and not e.scheduler.waiting and not e.pool.num_used:
                break
            await asyncio.sleep(0.01)
        return seen

    assert asyncio.run(main()) >= 6
    assert e.pool.num_used == 0 and not e.scheduler.running and not e.scheduler.waiting


def test_n_with_logprobs_and_stop(tiny: LlmEngine) -> None:
    e = tiny
    ids = e.encode_text("the cat")

    async def main() -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=2, n=3, logprobs=2)
        async for ev in e.generate(ids, params):
            out.setdefault(ev.index, []).extend(ev.logprobs or [])
        return out

    out = asyncio.run(main())
    assert sorted(out) == [0, 1, 2]
    assert all(lps and all(len(lp.top) == 2 for lp in lps) for lps in out.values())


def test_n_bounded(tiny: LlmEngine) -> None:
    with pytest.raises(InvalidInput, match="^n: expected an integer in \\[1, 16\\]"):
        SamplingParams.from_mapping({"n": 17})
    e = tiny
    ids = e.encode_text("the cat")
    room = e.pool.num_blocks * e.pool.block_size
    assert 4 * 510 < room < 16 * 500
    e.check_prompt(len(ids), SamplingParams(max_tokens=500, n=4))
    with pytest.raises(InvalidInput, match="^n: 16 answers"):
        e.check_prompt(len(ids), SamplingParams(max_tokens=500, n=16))
