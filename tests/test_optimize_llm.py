"""``rtserve optimize-llm`` on a random-weight Llama made from a transformers config: every
variant measured through rtserve's engine and scored against FP32 (+draft variants with a
smaller model or the model itself at int4 drafting), the choice written as a model
directory the engine serves (a draft choice with its draft model), the budget and noise
band applied by the chooser, and bad arguments refused naming the flag."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("transformers")

from rtserve.config import parse_model_config  # noqa: E402
from rtserve.optimize import llm as ollm  # noqa: E402
from rtserve.optimize.cli import main as cli_main  # noqa: E402
from rtserve.runtime.llm import kernels  # noqa: E402
from rtserve.runtime.llm.engine import LlmEngine  # noqa: E402
from rtserve.runtime.llm.params import SamplingParams  # noqa: E402
from tests.llm_models import build_llm, build_tokenizer  # noqa: E402

QUICK = ["--quick", "--threads", "1", "--streams", "1,4", "--no-progress"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llm")
    return build_llm(root, name="tiny", arch="llama", hidden=96, llm={"max_model_len": 256})


@pytest.fixture(scope="module")
def small(model: Path) -> Path:
    """A one-layer model beside ``tiny`` in its repository, with its tokenizer."""
    return build_llm(model.parent.parent, name="small", arch="llama", layers=1, seed=3)


def _generate(e: LlmEngine, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    async def go() -> list[int]:
        e.start()
        out: list[int] = []
        try:
            async for event in e.generate(prompt, params):
                out += event.token_ids
        finally:
            await e.stop()
        return out

    return asyncio.run(go())


def test_optimize_measures_each_variant_and_writes_a_servable_choice(
    model: Path, tmp_path: Path
) -> None:
    if kernels.quant_ops() is None:
        pytest.skip("rtserve's quantized-linear kernel cannot be built here")
    out = tmp_path / "repo" / "tiny"
    work = tmp_path / "work"
    args = ["optimize-llm", str(model), "--out", str(out), "--work", str(work),
            "--weights", "fp32,int8", "--speculative", "int8", *QUICK]  # fmt: skip
    assert cli_main(args) == 0
    report = (work / "report.md").read_text()
    rows = {m["name"]: m for m in json.loads((work / "report.json").read_text())}
    assert set(rows) == {"fp32", "int8", "int8+lookup"}
    for name, m in rows.items():
        assert f"`{name}`" in report
        assert m["throughput"]["1"] > 0 and m["throughput"]["4"] > 0
        assert len(m["round_throughput"]["4"]) == 2  # two alternating rounds
        assert m["metrics"]["ttft_p50_ms_1"] > 0 and m["peak_mem_mb"] >= 0
        assert 0.0 <= m["score"] <= 1.0 and m["metrics"]["ppl"] > 0
    assert rows["fp32"]["score"] == 1.0 and rows["fp32"]["metrics"]["kl"] == 0.0
    assert rows["int8"]["metrics"]["kl"] > 0.0  # int8 weights are not FP32's
    assert rows["int8+lookup"]["score"] == rows["int8"]["score"]
    # weights read per token: int8 with its scales, about 1.125 bytes a weight
    assert 0.25 < rows["int8"]["size_bytes"] / rows["fp32"]["size_bytes"] < 0.3
    record = json.loads((out / "optimization.json").read_text())
    chosen = record["chosen"]
    assert chosen in rows and "**chosen**" in report
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["backend"] == "llm" and config["llm"]["max_model_len"] == 256
    assert config["llm"]["weights"] == chosen.removesuffix("+lookup")
    assert ("speculative" in config["llm"]) == chosen.endswith("+lookup")
    # what `rtserve serve` loads: the written config, the linked checkpoint
    parsed = parse_model_config(config, "tiny", str(out / "config.yaml"))
    llm = dict(config["llm"], device="cpu", kv_cache_bytes=4 << 20, threads=1)
    from rtserve.runtime.llm.options import LlmOptions

    e = LlmEngine("tiny", "1", out / "1", LlmOptions.parse(llm, str(out / "config.yaml")))
    assert parsed.backend == "llm" and e.runner.weights == config["llm"]["weights"]
    assert len(_generate(e, e.encode_text("the cat"), 5)) == 5


def test_draft_variants_are_measured_and_a_draft_choice_is_written_servable(
    model: Path, small: Path, tmp_path: Path
) -> None:
    if kernels.quant_ops() is None:
        pytest.skip("rtserve's quantized-linear kernel cannot be built here")
    from rtserve.optimize.evaluate import Measurement
    from rtserve.runtime.llm.options import LlmOptions
    from rtserve.runtime.llm.quant import QuantLinear

    work = tmp_path / "work"
    args = ["optimize-llm", str(model), "--out", str(tmp_path / "repo" / "tiny"),
            "--work", str(work), "--weights", "fp32,int8", "--speculative", "int8",
            "--draft", "small", "--draft", "int4", *QUICK]  # fmt: skip
    assert cli_main(args) == 0
    rows = {m["name"]: m for m in json.loads((work / "report.json").read_text())}
    assert set(rows) == {"fp32", "int8", "int8+lookup", "int8+draft:small", "int8+draft:int4"}
    report = (work / "report.md").read_text()
    for name in ("int8+draft:small", "int8+draft:int4"):
        m = rows[name]
        assert f"`{name}`" in report and "drafts: " in " ".join(m["notes"])
        assert m["throughput"]["1"] > 0 and m["throughput"]["4"] > 0
        assert len(m["round_throughput"]["1"]) == 2 and m["metrics"]["ttft_p50_ms_1"] > 0
        assert m["score"] == rows["int8"]["score"]  # int8's quality: greedy output unchanged
    staged = yaml.safe_load((work / "draft-repo" / "int4" / "config.yaml").read_text())
    assert staged["llm"]["weights"] == "int4"

    # each draft chosen in turn: written beside --out (or found in its repository), served
    drafts = ollm.resolve_drafts(model, ("small", "int4"))
    options = ollm.LlmOptimizeOptions.quick(weights=("int8",), speculative=("int8",),
                                            drafts=drafts)  # fmt: skip
    repo = model.parent.parent
    cases = [("int8+draft:small", repo / "tiny-ref", "small", None),
             ("int8+draft:int4", tmp_path / "repo" / "tiny-self", "tiny-self-draft", "int4"),
             ("int8+draft:small", tmp_path / "repo" / "tiny-small", "tiny-small-draft", "fp32")]  # fmt: skip
    plain = LlmEngine("tiny", "1", model, LlmOptions.parse(
        {"device": "cpu", "kv_cache_bytes": 4 << 20, "threads": 1, "weights": "int8"}, "t"))  # fmt: skip
    prompt = plain.encode_text("the cat sat on the mat, the cat sat on the")
    expected = _generate(plain, prompt, 12)
    for name, out, draft_model, written in cases:
        chosen = Measurement(name, name, 0)
        ollm.publish_llm(out, model, ollm.LlmResult([chosen], chosen, 0.2, "", options))
        config = yaml.safe_load((out / "config.yaml").read_text())
        spec = config["llm"]["speculative"]
        assert spec["method"] == "draft" and spec["draft_model"] == draft_model
        assert config["llm"]["weights"] == "int8"
        record = json.loads((out / "optimization.json").read_text())
        assert record["draft"]["model"] == draft_model
        draft_dir = out.parent / draft_model
        assert (draft_dir / "1" / "config.json").is_file()
        if written is None:
            assert draft_dir == repo / "small" and record["draft"]["written"] is None
        else:
            draft_config = yaml.safe_load((draft_dir / "config.yaml").read_text())
            assert draft_config["backend"] == "llm" and draft_config["llm"]["weights"] == written
            assert "speculative" not in draft_config["llm"]
            parse_model_config(draft_config, draft_model, str(draft_dir / "config.yaml"))
        # what `rtserve serve` loads: the written config, the draft found by its name
        llm = dict(config["llm"], device="cpu", kv_cache_bytes=4 << 20, threads=1)
        parse_model_config(config, out.name, str(out / "config.yaml"))
        e = LlmEngine(out.name, "1", out / "1", LlmOptions.parse(llm, str(out / "config.yaml")))
        assert e.speculator is not None and e.speculator.draft is not None
        quantized = any(isinstance(m, QuantLinear) for m in e.speculator.draft.model.modules())
        assert quantized == (written == "int4")
        assert _generate(e, prompt, 12) == expected  # greedy speculative = plain greedy
        assert e.metrics.drafted > 0


def test_a_bad_draft_is_refused_naming_the_option(
    model: Path, small: Path, tmp_path: Path, capsys: Any
) -> None:
    other = tmp_path / "other" / "1"
    other.mkdir(parents=True)
    for f in small.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    build_tokenizer(vocab_size=300).save_pretrained(other)  # another tokenizer
    base = ["optimize-llm", str(model), "--out", str(tmp_path / "o"), *QUICK]
    assert cli_main([*base, "--draft", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--draft {other}: " in err and "has another tokenizer than this model" in err
    (tmp_path / "o-draft").mkdir()  # not written by optimize-llm: not overwritten
    assert cli_main([*base, "--draft", "int4"]) == 2
    assert "--draft: " in (err := capsys.readouterr().err) and "o-draft exists" in err
    assert not (tmp_path / "o").exists()


def _speed(tok_s: list[float]) -> Any:
    return ollm.Speed(tok_s={1: tok_s, 8: [x * 4 for x in tok_s]}, ttft_ms={1: [10.0]},
                      resident_mb=100.0, weight_bytes=1000)  # fmt: skip


def _quality(weights: str, top1: float, ppl: float) -> Any:
    from rtserve.runtime.llm.quality import Quality

    return Quality(weights, 100, top1, 0.01, ppl, 10.0, 0.9, 0.5, 4, 8)


def test_the_chooser_keeps_the_budget_and_the_noise_band() -> None:
    options = ollm.LlmOptimizeOptions(weights=("fp32", "bf16", "int8", "int4"), speculative=(),
                                      streams=(1, 8), rounds=3)  # fmt: skip
    speeds = {"fp32": _speed([100, 100, 100]), "bf16": _speed([110, 112, 111]),
              "int8": _speed([170, 160, 175]), "int4": _speed([250, 240, 260])}  # fmt: skip
    qualities = {"fp32": _quality("fp32", 1.0, 10.0), "bf16": _quality("bf16", 0.99, 10.01),
                 "int8": _quality("int8", 0.98, 10.1), "int4": _quality("int4", 0.9, 11.0)}  # fmt: skip
    ms = ollm.measurements(speeds, qualities, options)
    assert [ollm.in_budget(m, options) for m in ms] == [True, True, True, False]
    from rtserve.optimize.report import choose

    ok = [m for m in ms if ollm.in_budget(m, options)]
    assert choose(ok, 1.0, options.max_top1_drop, "fp32", 0.2).name == "int8"
    # perplexity over budget rules int8 out; bf16's 1.1x is inside the noise: FP32 is kept
    tight = ollm.LlmOptimizeOptions(weights=options.weights, speculative=(), streams=(1, 8),
                                    max_ppl_increase=0.005)  # fmt: skip
    ok = [m for m in ollm.measurements(speeds, qualities, tight) if ollm.in_budget(m, tight)]
    assert [m.name for m in ok] == ["fp32", "bf16"]
    assert choose(ok, 1.0, tight.max_top1_drop, "fp32", 0.2).name == "fp32"
    result = ollm.LlmResult(ms, ms[2], 0.2, "", options)
    table = result.table()
    assert "| `int8` |" in table and "**chosen**" in table and "over budget" in table


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--weights", "fp32,int3"], "--weights: unknown 'int3'"),
        (["--weights", "fp32", "--speculative", "int8"], "--speculative int8: not among"),
        (["--streams", "1,x"], "--streams: expected a comma list of integers"),
        (["--max-top1-drop", "2"], "--max-top1-drop: expected a number"),
        (["--rounds", "0"], "--rounds: expected an integer >= 1"),
        (["--draft", "nowhere"], "--draft nowhere: no directory 'nowhere' and no model"),
        (["--draft", "small@int3"], "--draft small@int3: unknown weight format 'int3'"),
        (["--draft", "int4", "--speculative", ""], "--draft: its variants are the"),
    ],
)
def test_bad_arguments_refused_naming_the_flag(
    model: Path, tmp_path: Path, capsys: Any, extra: list[str], message: str
) -> None:
    args = ["optimize-llm", str(model), "--out", str(tmp_path / "o"), *QUICK, *extra]
    assert cli_main(args) == 2
    assert message in capsys.readouterr().err


def test_a_directory_without_a_model_or_of_another_backend_is_refused(
    model: Path, tmp_path: Path, capsys: Any
) -> None:
    assert cli_main(["optimize-llm", str(tmp_path), "--out", str(tmp_path / "o"), *QUICK]) == 2
    assert "expected a model version directory with config.json" in capsys.readouterr().err
    other = tmp_path / "m"
    (other / "1").mkdir(parents=True)
    (other / "1" / "config.json").write_text((model / "config.json").read_text())
    (other / "config.yaml").write_text("backend: onnx\n")
    assert cli_main(["optimize-llm", str(other / "1"), "--out", str(tmp_path / "o"), *QUICK]) == 2
    assert "backend: expected llm, got 'onnx'" in capsys.readouterr().err
