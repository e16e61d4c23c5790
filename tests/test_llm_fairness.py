"""Fair share of a generative model between tenants, and unread streams paused.

The scheduler's share is tested as a pure function of its state (sequences with explicit
arrival times, steps driven by hand: no clock, no model); pausing a stream nobody reads is
tested on a real engine over a tiny random-weight model, in-process (a consumer that stops
iterating without closing)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rtserve.errors import ConfigError
from rtserve.runtime.llm.kv import BlockPool
from rtserve.runtime.llm.options import LlmOptions
from rtserve.runtime.llm.params import SamplingParams
from rtserve.runtime.llm.scheduler import PAUSED, RUNNING, WAITING, Scheduler, Sequence

PARAMS = SamplingParams(max_tokens=64, temperature=0.0)


def seq(tenant: str, at: int, prompt: int = 6, new: int = 64, priority: int = 0) -> Sequence:
    return Sequence(
        tokens=list(range(1, prompt + 1)),
        num_prompt=prompt,
        params=PARAMS,
        max_len=prompt + new,
        detok=None,  # type: ignore[arg-type]  # (the scheduler never reads text)
        priority=priority,
        arrival_ns=at,
        tenant=tenant,
    )


def scheduler(max_num_seqs: int = 8, blocks: int = 512, **kw: object) -> Scheduler:
    return Scheduler(BlockPool(blocks, 4, False), max_num_seqs, 512, **kw)  # type: ignore[arg-type]


def step(s: Scheduler) -> list[Sequence]:
    """One step as the engine runs it: schedule, compute, sample a token for each sequence
    whose tokens are all computed, finish those at their length. Returns who ran."""
    st = s.schedule()
    s.after_step(st)
    for q, _ in st.items:
        if q.computed == len(q.tokens):
            q.tokens.append(7)
            if len(q.tokens) >= q.max_len:
                s.finish(q)
    return [q for q, _ in st.items]


def running(s: Scheduler, tenant: str) -> int:
    return sum(1 for q in s.running if q.tenant == tenant)


def test_a_second_tenant_gets_a_slot_at_the_next_step() -> None:
    s = scheduler(max_num_seqs=8)
    hog = [seq("a", at=i) for i in range(24)]
    for q in hog:
        s.add(q)
    for _ in range(3):
        step(s)
    assert running(s, "a") == 8 and len(s.waiting) == 16  # a lone tenant: every slot
    assert s.fair_preemptions == 0
    b = seq("b", at=100)
    s.add(b)
    ran = step(s)
    assert b in ran and b.status == RUNNING
    assert running(s, "a") == 7 and s.fair_preemptions == 1
    victim = max((q for q in hog if q.preemptions), key=lambda q: q.arrival_ns)
    assert victim.status == WAITING and not victim.blocks  # the newest running one, freed
    for _ in range(5):  # no churn: a stays at 7 while b runs
        step(s)
        assert running(s, "b") == 1 and running(s, "a") == 7
    assert s.fair_preemptions == 1
    while b.status != 2:  # (FINISHED)
        step(s)
    step(s)
    assert running(s, "a") == 8  # b gone: a takes the slot back (work-conserving)


def test_a_lone_tenant_uses_every_slot_and_is_never_preempted_for_fairness() -> None:
    s = scheduler(max_num_seqs=6)
    for i in range(20):
        s.add(seq("a", at=i, new=4))
    peak = 0
    while s.has_work():
        step(s)
        peak = max(peak, len(s.running))
    assert peak == 6 and s.fair_preemptions == 0 and s.preemptions == 0
    assert s.pool.num_used == 0


def test_waiting_tenants_are_admitted_round_robin() -> None:
    s = scheduler(max_num_seqs=8)
    for i in range(10):  # a's ten arrived before any of b's and c's
        s.add(seq("a", at=i))
    for i in range(10):
        s.add(seq("b", at=100 + i))
        s.add(seq("c", at=200 + i))
    step(s)
    counts = sorted(running(s, t) for t in "abc")
    assert counts == [2, 3, 3] and len(s.running) == 8


def test_quotas_follow_the_weights() -> None:
    s = scheduler(max_num_seqs=8, weights={"gold": 3.0})
    for i in range(20):
        s.add(seq("other", at=i))
    step(s)
    assert running(s, "other") == 8
    for i in range(20):
        s.add(seq("gold", at=100 + i))
    step(s)
    assert s.quotas() == {"gold": 6, "other": 2}
    assert running(s, "gold") == 6 and running(s, "other") == 2
    assert s.fair_preemptions == 6


def test_fair_share_off_is_first_come_first_served() -> None:
    s = scheduler(max_num_seqs=4, fair_share=False)
    for i in range(8):
        s.add(seq("a", at=i))
    step(s)
    b = seq("b", at=100)
    s.add(b)
    step(s)
    assert b.status == WAITING and s.fair_preemptions == 0


def test_a_more_urgent_sequence_is_not_preempted_for_a_share() -> None:
    s = scheduler(max_num_seqs=4)
    for i in range(6):
        s.add(seq("a", at=i, priority=-5))  # (a key granted urgency)
    step(s)
    b = seq("b", at=100)
    s.add(b)
    step(s)
    assert b.status == WAITING and s.fair_preemptions == 0
    urgent_b = seq("b", at=101, priority=-5)
    s.add(urgent_b)
    step(s)
    assert urgent_b.status == RUNNING and s.fair_preemptions == 1


def test_a_tenant_holding_the_kv_pool_yields_blocks_to_another() -> None:
    # 16 blocks of 4 tokens; a's 4 sequences of 15+ tokens hold all of them: slots are free
    # (max_num_seqs 8) but no block is (and a's own decodes preempt each other for blocks).
    s = scheduler(max_num_seqs=8, blocks=16)
    hog = [seq("a", at=i, prompt=15, new=40) for i in range(4)]
    for q in hog:
        s.add(q)
    for _ in range(2):
        step(s)
    assert s.pool.num_free == 0 and running(s, "a") == 4
    b = seq("b", at=100, prompt=3, new=8)
    s.add(b)
    ran = step(s)
    assert b in ran and b.status == RUNNING
    while b.status != 2:
        step(s)
        # KV pressure preempts the tenant furthest above its share, never b.
        assert b.preemptions == 0
    assert b.generated == 8


def test_kv_pressure_preempts_the_tenant_above_its_share() -> None:
    # Blocks run out as four sequences decode: the victim is not the newest (b's, alone)
    # but the newest of a, which holds three of the four running.
    s = scheduler(max_num_seqs=8, blocks=20)
    early_a = [seq("a", at=i, prompt=4, new=60) for i in range(3)]
    for q in early_a:
        s.add(q)
    late_b = seq("b", at=10, prompt=4, new=60)
    s.add(late_b)
    while s.preemptions == 0:
        step(s)
    assert late_b.preemptions == 0
    assert early_a[2].preemptions == 1


def test_pause_frees_the_blocks_and_resume_recomputes() -> None:
    s = scheduler(max_num_seqs=4)
    q = seq("a", at=0)
    s.add(q)
    for _ in range(3):
        step(s)
    assert q.blocks and q.status == RUNNING
    tokens = list(q.tokens)
    s.pause(q)
    assert q.status == PAUSED and not q.blocks and s.pool.num_used == 0
    assert not s.has_work() and s.paused == [q]
    s.resume(q)
    assert q.status == WAITING and not s.paused
    step(s)
    assert q.status == RUNNING and q.tokens[: len(tokens)] == tokens
    assert q.computed == len(tokens)  # all its tokens computed again in one chunk
    s.pause(q)
    s.finish(q)  # (a paused stream whose client went away)
    assert not s.paused and s.pool.num_used == 0


def test_fairness_options_are_checked() -> None:
    opts = LlmOptions.parse(
        {
            "tenant_weights": {"gold": 3, "bronze": 0.5},
            "max_waiting_per_tenant": 8,
            "unread_timeout_s": 0.5,
            "min_priority": -10,
        },
        "c.yaml",
    )
    assert opts.tenant_weights == (("bronze", 0.5), ("gold", 3.0))
    assert opts.unread_timeout_s == 0.5 and opts.min_priority == -10
    assert LlmOptions.parse({}, "c.yaml").min_priority == 0
    bad = [
        ({"tenant_weights": {"gold": 0}}, "llm.tenant_weights.gold: expected a weight"),
        ({"tenant_weights": ["gold"]}, "llm.tenant_weights: expected a mapping"),
        ({"unread_timeout_s": -1}, "llm.unread_timeout_s: expected seconds"),
        ({"min_priority": 5}, r"llm.min_priority: expected an integer in \[-100, 0\]"),
        ({"fair_share": "yes"}, "llm.fair_share: expected true or false"),
        ({"max_waiting_per_tenant": -1}, "llm.max_waiting_per_tenant"),
    ]
    for data, message in bad:
        with pytest.raises(ConfigError, match=message):
            LlmOptions.parse(data, "c.yaml")


# ---------------------------------------------------------------- a real engine, in-process
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rtserve.runtime.llm.engine import LlmEngine  # noqa: E402
from tests.llm_models import build_llm  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llm(tmp_path_factory.mktemp("fair"), "tiny")


def test_a_stream_left_unread_is_paused_then_resumed_when_read(tiny: Path) -> None:
    opts = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 512, "threads": 1}
    e = LlmEngine("tiny", "1", tiny, LlmOptions.parse({**opts, "unread_timeout_s": 0.3}, "t"))
    e.start()
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

    async def go() -> None:
        ids = e.encode_text("the cat sat on the mat")
        unread = e.generate(ids, params)
        first = await unread.__anext__()  # then it takes nothing for a while
        for _ in range(300):
            if e.stalled:
                break
            await asyncio.sleep(0.01)
        assert e.stalled == 1 and e.metrics.counts()["stalled"] == 1
        assert len(e.scheduler.paused) == 1 and e.pool.num_used == 0
        assert e._gauges()["paused"] == 1 and not e.busy
        steps = e.steps
        await asyncio.sleep(0.2)
        assert e.steps == steps  # nothing decodes for a stream nobody reads
        # Another request runs meanwhile; then the stalled one is read to its end.
        other = [ev async for ev in e.generate(ids, SamplingParams(max_tokens=4))]
        assert other[-1].finished
        tokens = list(first.token_ids)
        async for event in unread:
            tokens += event.token_ids
        assert len(tokens) == 300 and event.finish_reason == "length"
        assert not e.scheduler.paused and e.pool.num_used == 0
        await e.stop()

    asyncio.run(go())


def test_a_paused_stream_whose_consumer_leaves_is_aborted_and_freed(tiny: Path) -> None:
    opts = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 512, "threads": 1}
    e = LlmEngine("tiny", "1", tiny, LlmOptions.parse({**opts, "unread_timeout_s": 0.2}, "t"))
    e.start()
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def go() -> None:
        unread = e.generate(e.encode_text("a warm mat"), params)
        await unread.__anext__()
        for _ in range(300):
            if e.scheduler.paused:
                break
            await asyncio.sleep(0.01)
        assert e.scheduler.paused
        await unread.aclose()  # (the client went away)
        for _ in range(100):
            if not e.scheduler.paused:
                break
            await asyncio.sleep(0.01)
        assert not e.scheduler.paused and e.metrics.finished["abort"] == 1
        assert e.pool.num_used == 0
        await e.stop()

    asyncio.run(go())
