"""Quantized weights for ``backend: llm`` (``llm.weights``): the kernel against a dequantized
reference on odd shapes, its AVX2 and plain loops and torch's fallback against each other,
each format through the engine on random-weight Llama and Qwen2, int8 on SmolLM2 against
FP32, and a bad value refused with the file and field named."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rtserve.config import load_yaml, parse_model_config  # noqa: E402
from rtserve.errors import ConfigError  # noqa: E402
from rtserve.runtime.llm import kernels, quality, quant  # noqa: E402
from rtserve.runtime.llm.options import LlmOptions  # noqa: E402
from rtserve.runtime.llm.quant import (  # noqa: E402
    QuantLinear,
    linear_children,
    quantize_int4,
    quantize_int8,
)
from tests.llm_models import build_llm, generate_greedy, start_engine  # noqa: E402

FORMATS = ["bf16", "int8", "int4"]
ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "examples" / "llm-repository" / "smollm2" / "1"


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    built = kernels.quant_ops()
    if built is None:
        pytest.skip("rtserve's quantized-linear kernel cannot be built here")
    return built


def _linear(n: int, k: int, bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.rand(n, 1) * 4)  # rows of different scales
    return lin


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(37, 70), (1, 32), (33, 129)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 20])
def test_the_kernel_matches_a_dequantized_matmul_on_odd_shapes(ops, fmt, n, k, m) -> None:  # type: ignore[no-untyped-def]
    lin = _linear(n, k, bias=n % 2 == 1)
    q = QuantLinear(lin, fmt, ops)
    q.kernel_rows = 64
    x = torch.randn(m, k)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x.double(), q.dequantized().double(), None)
        if lin.bias is not None:
            want += lin.bias.double()
        scale = (x.abs().double() @ q.dequantized().abs().double().t()).max()
        q.act = 0  # weights widened to float32: exact up to float32 sums
        assert (q(x).double() - want).abs().max() <= 1e-5 * scale
        # int8 activations: their rounding error (half a step of 1/127 of each group's
        # largest) times the quantized values' magnitudes (int4's without its minimum)
        q.act = 1 if fmt != "bf16" else 0
        w = q.dequantized().double()
        if fmt == "int4":
            w -= q.mins.double().repeat_interleave(32, dim=1)[:, :k]
        step = x.view(m, -1).abs().double()
        groups = torch.nn.functional.pad(step, (0, -k % 32)).view(m, -1, 32).amax(dim=2)
        step = groups.repeat_interleave(32, dim=1)[:, :k] / 254
        bound = (step @ w.abs().t()).max()
        assert (q(x).double() - want).abs().max() <= bound * 1.01 + 1e-5 * scale
        q.act = 2 if fmt != "bf16" else 0  # int16 activations (the default): ~ float32's
        assert (q(x).double() - want).abs().max() <= 1e-4 * scale
        assert q(x).shape == (m, n)


def test_the_dequantized_weights_are_close_to_the_originals() -> None:
    w = _linear(48, 100, bias=False).weight.detach()
    q8, s8 = quantize_int8(w)
    assert q8.shape == (48, 128) and s8.shape == (48, 4)
    back = (q8.view(48, 4, 32).float() * s8[..., None]).view(48, 128)[:, :100]
    assert (back - w).abs().max() <= s8.max() / 2 + 1e-7
    assert bool((q8[:, 100:] == 0).all())  # the padding multiplies nothing
    packed, s4, lo = quantize_int4(w)
    assert packed.shape == (48, 64) and packed.dtype == torch.uint8
    q4 = QuantLinear(torch.nn.Linear(100, 48, bias=False), "int4", None)
    q4.qweight, q4.scales, q4.mins = packed, s4, lo
    err4 = (q4.dequantized() - w).abs().max()
    assert err4 < (w.abs().max() / 7)  # 16 levels over each group's range
    assert err4 > (back - w).abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", [0, 1, 2])
@pytest.mark.parametrize("m", [6, 20])  # integer dot products; float32 tiles
def test_the_avx2_loops_plain_loops_and_torch_agree(ops, fmt, act, m) -> None:  # type: ignore[no-untyped-def]
    if not ops.has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA: the plain loops are the only ones")
    lin = _linear(300, 576, bias=True)
    x = torch.randn(m, 576)
    q = QuantLinear(lin, fmt, ops, act=act)
    plain = QuantLinear(lin, fmt, ops, act=act)
    plain.simd = False
    fallback = QuantLinear(lin, fmt, None)  # no kernel: torch operators
    with torch.inference_mode():
        a, b = q(x), plain(x)
        c = fallback(x)
    scale = float(c.abs().max())
    assert (a - b).abs().max() <= 1e-5 * scale  # the same sums, in another order
    tol = {0: 1e-5, 1: 1 / 100, 2: 1e-4}[q.act]
    assert (a - c).abs().max() <= tol * scale


def test_many_rows_use_dequantized_tiles_and_match_the_kernel(ops) -> None:  # type: ignore[no-untyped-def]
    lin = _linear(5000, 64, bias=False)  # more output rows than one tile
    q = QuantLinear(lin, "int8", ops, act=0)
    x = torch.randn(40, 64)
    q.kernel_rows = 16
    with torch.inference_mode():
        tiled = q(x)  # 40 rows > kernel_rows: dequantized tiles and torch's GEMM
        q.kernel_rows = 64
        kernel = q(x)
    assert (tiled - kernel).abs().max() <= 1e-4 * float(tiled.abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_path_of_the_kernel_matches_float64_on_smollm2_shapes(ops, fmt) -> None:  # type: ignore[no-untyped-def]
    # Few rows (int8: up to 31, int4: up to 11): integer dot products, 4 weight rows a pass
    # (int16 activations: ~float32's result; int8: llama.cpp's Q8_0 x Q8_0 error); more rows
    # (and bf16 from 8): float32 tiles of 16 columns
    # (1000 columns: a tail of 8); two threads split the columns and give the same bits.
    lin = _linear(1000, 576, bias=True, seed=3)
    q = QuantLinear(lin, fmt, ops)
    w = q.dequantized().double()
    threads = torch.get_num_threads()
    try:
        for m in (1, 2, 3, 7, 8, 11, 12, 13, 31, 32):
            x = torch.randn(m, 576)
            want = x.double() @ w.t() + lin.bias.detach().double()
            scale = float((x.abs().double() @ w.abs().t()).max())
            with torch.inference_mode():
                torch.set_num_threads(1)
                one = q(x)
                torch.set_num_threads(2)
                two = q(x)
                assert torch.equal(one, two), m
                assert (one.double() - want).abs().max() <= 1e-5 * scale, m
                if fmt == "int8" and m < 8:  # int8 activations: half a step of 1/127 a group
                    q.act = 1
                    err = (q(x).double() - want).abs().max()
                    q.act = 2
                    assert 1e-5 * scale < err <= scale / 254, m
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llm")
    return {arch: build_llm(root, name=arch, arch=arch, hidden=96) for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_loads_and_generates_what_its_model_generates(
    models: dict[str, Path], arch: str, fmt: str, ops
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    e = start_engine(models[arch], weights=fmt, block_size=4)
    layers = [m for m in e.runner.model.modules() if isinstance(m, QuantLinear)]
    assert layers and {m.fmt for m in layers} >= {"int8" if fmt == "int4" else fmt}
    assert e.runner.model.lm_head.fmt == ("int8" if fmt == "int4" else fmt)
    prompts = [e.encode_text(t) for t in ("the cat", "rain fell", "a warm mat")]
    got = generate_greedy(e, prompts, 10)
    assert e.pool.num_used == 0
    # the same model quantized the same way, one prompt at a time in transformers' generate
    ref = AutoModelForCausalLM.from_pretrained(models[arch]).eval()
    twin = quality.quantized(ref, fmt, ops)
    with torch.inference_mode():
        for ids, tokens in zip(prompts, got, strict=True):
            g = twin.generate(
                torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False
            )
            assert tokens == g[0, len(ids) :].tolist()


def test_a_bad_weights_value_is_refused_naming_the_file_and_field(tmp_path: Path) -> None:
    version = build_llm(tmp_path, name="bad", llm={"weights": "int3"})
    path = version.parent / "config.yaml"
    config = parse_model_config(load_yaml(path), "bad", str(path))
    with pytest.raises(ConfigError) as err:
        LlmOptions.parse(config.backend_options, config.source)
    assert str(path) in str(err.value)
    assert "llm.weights" in str(err.value) and "int8" in str(err.value)
    assert "int3" in str(err.value)


# Greedy tokens of int8 SmolLM2 equal to FP32's: on these two prompts the first 16 were
# (measured); over quality.py's 8 chat prompts x 32 tokens the mean equal prefix was 0.61 of
# 32, 4 of 8 equal in full, so N stays at 16 on prompts checked to hold it.
SMOL_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
SMOL_EQUAL = 16


@pytest.mark.skipif(not SMOLLM2.is_dir(), reason="needs make examples (SmolLM2)")
def test_int8_smollm2_greedy_text_agrees_with_fp32(ops) -> None:  # type: ignore[no-untyped-def]
    runs = {}
    for fmt in ("fp32", "int8"):
        e = start_engine(SMOLLM2, weights=fmt, threads=0, kv_cache_bytes=32 << 20)
        tok = e.tokenizer
        prompts = [
            e.encode_text(
                tok.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
            )
            for p in SMOL_PROMPTS
        ]
        runs[fmt] = generate_greedy(e, prompts, SMOL_EQUAL)
    for a, b in zip(runs["fp32"], runs["int8"], strict=True):
        assert a == b


def test_int8_preemption_and_prefix_cache_give_the_same_tokens(
    models: dict[str, Path], ops
) -> None:  # type: ignore[no-untyped-def]
    roomy = start_engine(models["llama"], weights="int8", block_size=4)
    prompts = [roomy.encode_text("the cat sat on a warm mat " * (1 + i % 3)) for i in range(12)]
    want = generate_greedy(roomy, prompts, 12)
    # 160 token slots for 12 sequences of up to ~45 tokens: sequences are preempted
    tight = start_engine(models["llama"], weights="int8", block_size=4, kv_cache_bytes=80 << 10)
    assert generate_greedy(tight, prompts, 12) == want
    assert tight.scheduler.preemptions > 0
    assert tight.pool.num_used == 0 and tight.pool.hits > 0


def _output_error(x: torch.Tensor, w: torch.Tensor, packed, s, lo) -> float:  # type: ignore[no-untyped-def]
    q = QuantLinear(torch.nn.Linear(w.shape[1], w.shape[0], bias=False), "int4", None)
    q.qweight, q.scales, q.mins = packed, s, lo
    return float(((x @ w.t() - x @ q.dequantized().t()) ** 2).mean())


def test_gptq_lowers_int4_output_error_and_keeps_weights_already_on_the_grid() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    # inputs with correlated channels (as a model's hidden states are), some much larger
    x = torch.randn(512, 96) @ (torch.randn(96, 96) * 0.3 + torch.eye(96))
    x[:, :5] *= 6
    h = x.double().t() @ x.double() / x.shape[0]
    rtn = _output_error(x, w, *quantize_int4(w))
    gptq = _output_error(x, w, *quant.gptq_int4(w, h))
    assert gptq < 0.6 * rtn
    # weights that already lie on a 4-bit grid (a checkpoint from a 4-bit file) stay exact
    q4 = QuantLinear(torch.nn.Linear(96, 64, bias=False), "int4", None)
    q4.qweight, q4.scales, q4.mins = quantize_int4(w)
    on_grid = q4.dequantized()
    packed, s, lo = quant.gptq_int4(on_grid, h)
    assert _output_error(x, on_grid, packed, s, lo) < 1e-10


def test_int4_calibration_brings_a_random_llama_within_the_perplexity_budget(
    models: dict[str, Path], ops
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vd = models["llama"]
    ref = AutoModelForCausalLM.from_pretrained(vd).eval()
    tok = AutoTokenizer.from_pretrained(vd)
    chunks = quality.token_chunks(tok, quality.held_out_text(), 600, 200)
    calibrated = quality.quantized(ref, "int4", ops)
    assert all(
        getattr(m, "_rt_int4", None) is not None
        for n, m in calibrated.named_modules()
        if isinstance(m, torch.nn.Linear) and m._rt_weights == "int4"  # type: ignore[comparison-overlap]
    )
    rounded = copy.deepcopy(ref)
    quant.plan(rounded, "int4")  # no calibrate(): round to nearest
    for parent, name, child in linear_children(rounded):
        setattr(parent, name, quant.maker(ops)(child))
    _, _, kl_cal, ppl_ref, ppl_cal = quality.teacher_forced(ref, calibrated, chunks)
    _, _, kl_rtn, _, ppl_rtn = quality.teacher_forced(ref, rounded, chunks)
    assert kl_cal < 0.7 * kl_rtn
    assert abs(ppl_cal / ppl_ref - 1) < 0.02
    assert abs(ppl_cal / ppl_ref - 1) < abs(ppl_rtn / ppl_ref - 1)
