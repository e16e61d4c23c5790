"""The decode stack (csrc/decode_stack.h): a decode step of int8 / int4 Llama and Qwen2 layers
in one call gives the same logits, bit for bit, as the one-operation-per-call path, on one
and several rows, with one and two threads; models it cannot run keep the other path; bad
arguments are refused naming the argument."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rtserve.runtime.llm import kernels  # noqa: E402
from rtserve.runtime.llm.options import LlmOptions  # noqa: E402
from rtserve.runtime.llm.runner import ModelRunner  # noqa: E402
from rtserve.runtime.llm.scheduler import Sequence, Step  # noqa: E402
from tests.llm_models import build_llm, generate_greedy, start_engine  # noqa: E402

PROMPTS = ["the cat sat on a warm mat", "rain fell", "a warm mat by the door of the house"]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if kernels.quant_ops() is None or kernels.fused_ops() is None:
        pytest.skip("rtserve's CPU kernels cannot be built here")


def _runner(version: Path, weights: str, threads: int = 1) -> ModelRunner:
    options = LlmOptions(
        device="cpu", weights=weights, threads=threads, block_size=4, kv_cache_bytes=4 << 20
    )
    return ModelRunner(version, options)


def _sequences(runner: ModelRunner, first_block: int) -> list[Sequence]:
    out = []
    for i, text in enumerate(PROMPTS):
        ids = runner.tokenizer(text)["input_ids"]
        seq = Sequence(tokens=list(ids), num_prompt=len(ids), params=None, max_len=64, detok=None)  # type: ignore[arg-type]
        seq.blocks = list(range(first_block + 16 * i, first_block + 16 * (i + 1)))
        out.append(seq)
    return out


def _run(
    runner: ModelRunner, seqs: list[Sequence], n: int, stacked: bool, stack: object
) -> torch.Tensor:
    runner.stack = stack if stacked else None
    step = Step(
        items=[(s, n) for s in seqs],
        decodes=len(seqs) if n == 1 else 0,
        prefill_tokens=0 if n == 1 else n * len(seqs),
    )
    logits = runner.forward(step, list(range(len(seqs))))
    for s in seqs:
        s.computed += n
    return logits


def _compare(runner: ModelRunner, rows: int, steps: int = 12) -> None:
    """Decode ``steps`` tokens on ``rows`` sequences both ways (separate blocks, the same
    tokens fed to both): every step's logits equal."""
    stack = runner.stack
    assert stack is not None
    a, b = _sequences(runner, 0)[:rows], _sequences(runner, 48)[:rows]
    for sa, sb in zip(a, b, strict=True):  # prompts one at a time: prefill, not the stack
        for s, stacked in ((sa, True), (sb, False)):
            token = int(_run(runner, [s], len(s.tokens), stacked, stack)[0].argmax())
        for s in (sa, sb):
            s.tokens.append(token)
    for _ in range(steps):  # past a block boundary (block_size 4) more than once
        la = _run(runner, a, 1, True, stack)
        lb = _run(runner, b, 1, False, stack)
        assert torch.equal(la, lb)
        for r, token in enumerate(lb.argmax(dim=1).tolist()):
            a[r].tokens.append(token)
            b[r].tokens.append(token)
    runner.stack = stack


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_stack_gives_the_same_logits_as_one_call_per_operation(
    tmp_path: Path, arch: str, weights: str, threads: int
) -> None:
    version = build_llm(tmp_path, arch=arch, hidden=128, layers=2)  # head size 32
    before = torch.get_num_threads()
    try:
        runner = _runner(version, weights, threads)
        assert runner.stack is not None and runner.stack_rows >= 3
        assert runner.stack.num_layers() == 2
        _compare(runner, rows=1)
        _compare(runner, rows=3)
    finally:
        torch.set_num_threads(before)


def test_head_size_64_and_the_generic_head_size(tmp_path: Path) -> None:
    for name, hidden in (("d64", 256), ("d16", 64)):  # head sizes 64 and 16
        runner = _runner(build_llm(tmp_path, name=name, hidden=hidden), "int8")
        assert runner.stack is not None
        _compare(runner, rows=2, steps=6)


def test_fp32_and_odd_widths_keep_the_one_call_per_operation_path(tmp_path: Path) -> None:
    assert _runner(build_llm(tmp_path, name="f32", hidden=64), "fp32").stack is None
    odd = _runner(build_llm(tmp_path, name="odd", hidden=48), "int8")  # 48: not 32's multiple
    assert odd.stack is None
    seqs = _sequences(odd, 0)[:1]
    logits = _run(odd, seqs, len(seqs[0].tokens), False, None)
    assert logits.shape == (1, odd.vocab_size) and bool(torch.isfinite(logits).all())


def test_bad_arguments_are_refused_naming_them(tmp_path: Path) -> None:
    runner = _runner(build_llm(tmp_path, hidden=64), "int8")
    stack = runner.stack
    assert stack is not None
    dim = 16
    x = torch.zeros(1, 64)
    cos, sin = torch.ones(1, dim), torch.zeros(1, dim)
    good = dict(slots=torch.tensor([0]), tables=torch.tensor([[0]]), lengths=torch.tensor([1]))

    def call(**changes: object) -> None:
        args = {**good, **changes}
        stack.run(
            changes.get("x", x), cos, sin, runner.k_cache, runner.v_cache,
            args["slots"], args["tables"], args["lengths"],
        )  # fmt: skip

    call()  # (a valid step runs)
    for field, change in (
        ("slots", {"slots": torch.tensor([10**9])}),
        ("lengths", {"lengths": torch.tensor([99])}),
        ("tables", {"tables": torch.tensor([[10**9]])}),
        ("x", {"x": torch.zeros(1, 63)}),
        ("x", {"x": torch.zeros(20, 64)}),
    ):
        with pytest.raises(RuntimeError, match=field):
            call(**change)


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(tmp_path: Path) -> None:
    """Batch invariance: one sequence decoded alone and beside two others, the same bits
    (what makes verified drafts equal plain decoding)."""
    runner = _runner(build_llm(tmp_path, hidden=128), "int8", threads=2)
    stack = runner.stack
    alone, crowd = _sequences(runner, 0)[:1], _sequences(runner, 48)
    for group in (alone, crowd):
        for s in group:
            s.tokens.append(int(_run(runner, [s], len(s.tokens), False, stack)[0].argmax()))
    for _ in range(6):
        a = _run(runner, alone, 1, True, stack)
        b = _run(runner, crowd, 1, True, stack)
        assert torch.equal(a[0], b[0])
        for s, token in zip(crowd, b.argmax(dim=1).tolist(), strict=True):
            s.tokens.append(token)
        alone[0].tokens.append(crowd[0].tokens[-1])


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_prompt_lookup_verifies_drafts_in_the_stack_and_equals_plain_greedy(
    tmp_path: Path, weights: str
) -> None:
    version = build_llm(tmp_path, hidden=128)

    def generate(spec: dict | None) -> tuple[list[list[int]], Any, int]:
        options: dict = {"weights": weights, "block_size": 4, "kv_cache_bytes": 4 << 20}
        e = start_engine(version, threads=2, speculative=spec, **options)
        calls = {"drafted": 0}
        plain = e.runner._run_stack

        def counted(step, rows, extra):  # type: ignore[no-untyped-def]
            calls["drafted"] += sum(1 for _, n in step.items if n > 1)
            return plain(step, rows, extra)

        e.runner._run_stack = counted
        prompts = [e.encode_text("the cat sat on the mat " * (2 + i)) for i in range(2)]
        return generate_greedy(e, prompts, 24), e, calls["drafted"]

    want, _, _ = generate(None)
    got, spec, drafted_in_stack = generate({"method": "prompt_lookup", "num_tokens": 4})
    assert got == want
    assert spec.metrics.accepted > 0 and drafted_in_stack > 0
    assert spec.pool.num_used == 0
