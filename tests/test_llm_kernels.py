"""The CPU kernels (llm/csrc/paged_attention.cpp): paged attention against PyTorch's own
attention over gathered blocks, its checks on hostile tables, the fused RMSNorm and SiLU gate
against transformers' modules, and the engine on either path."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from rtserve.errors import ConfigError  # noqa: E402
from rtserve.runtime.llm import kernels  # noqa: E402
from rtserve.runtime.llm.engine import LlmEngine  # noqa: E402
from rtserve.runtime.llm.options import LlmOptions  # noqa: E402
from rtserve.runtime.llm.params import SamplingParams  # noqa: E402
from tests.llm_models import build_llm  # noqa: E402


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    found = kernels.paged_decode()
    if found is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the engine uses PyTorch's attention")
    assert found is not None, "g++ is here but the kernel did not build (see the log)"
    return found


def reference(q, kc, vc, tables, lengths, scale):  # type: ignore[no-untyped-def]
    """PyTorch's path: gather each sequence's blocks (padded), mask, SDPA per kv group."""
    nd, heads, dim = q.shape
    _, bs, kvh, _ = kc.shape
    width = tables.shape[1] * bs
    keys = kc.index_select(0, tables.reshape(-1)).view(nd, width, kvh, dim).permute(0, 2, 1, 3)
    values = vc.index_select(0, tables.reshape(-1)).view(nd, width, kvh, dim).permute(0, 2, 1, 3)
    mask = (torch.arange(width)[None, :] < lengths[:, None])[:, None, None, :]
    qd = q.view(nd, kvh, heads // kvh, dim)
    out = F.scaled_dot_product_attention(qd, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(nd, heads, dim)


# head sizes with a vector path (32, 64, 128) and without (80); groups of 1 to 8 query heads
# per kv head (8 x 128 is split into register-sized parts); blocks of 4 and 16 tokens
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "bs"),
    [(6, 2, 32, 4), (4, 4, 64, 4), (9, 3, 64, 4), (9, 3, 64, 16), (14, 2, 64, 16),
     (4, 2, 128, 4), (32, 4, 128, 16), (16, 16, 32, 16), (2, 1, 80, 4)],
)  # fmt: skip
def test_kernel_equals_torch_attention_over_gathered_blocks(
    kernel, heads: int, kv_heads: int, dim: int, bs: int
) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(heads * dim + bs)
    nd, width = 9, 36 // bs + 5
    blocks = nd * width + 8
    kc = torch.randn(blocks, bs, kv_heads, dim, generator=g)
    vc = torch.randn(blocks, bs, kv_heads, dim, generator=g)
    tables = torch.randperm(blocks, generator=g)[: nd * width].view(nd, width)
    # 1 token .. every slot of the table; 16-token runs cut anywhere
    lengths = torch.tensor([1, 2, 5, 15, 16, 17, 30, 33, width * bs])
    q = torch.randn(nd, heads, dim, generator=g) * 3
    got = kernel(q, kc, vc, tables, lengths, dim**-0.5)
    want = reference(q, kc, vc, tables, lengths, dim**-0.5)
    assert got.shape == (nd, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_out_of_range_tables_and_lengths(kernel) -> None:  # type: ignore[no-untyped-def]
    kc = torch.zeros(8, 4, 2, 16)
    q = torch.zeros(2, 4, 16)
    tables = torch.tensor([[0, 1], [2, 3]])
    ok = kernel(q, kc, kc, tables, torch.tensor([8, 3]), 0.25)
    assert torch.isfinite(ok).all()
    with pytest.raises(RuntimeError, match=r"tables\[1, 0\] = 99 out of range"):
        kernel(q, kc, kc, torch.tensor([[0, 1], [99, 3]]), torch.tensor([8, 3]), 0.25)
    with pytest.raises(RuntimeError, match=r"lengths\[0\] out of range"):
        kernel(q, kc, kc, tables, torch.tensor([9, 3]), 0.25)
    with pytest.raises(RuntimeError, match="query: expected Float"):
        kernel(q.double(), kc, kc, tables, torch.tensor([8, 3]), 0.25)


def test_kernel_reads_queries_in_place_from_a_wider_row(kernel) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(2, 16, 8, 2, 64, generator=g)
    tables, lengths = torch.tensor([[0, 1], [1, 0]]), torch.tensor([16, 9])
    rows = torch.randn(2, 6 * 64, generator=g)  # q, then two kv heads' keys and values
    q = rows[:, : 4 * 64].view(2, 4, 64)
    assert not q.is_contiguous()
    torch.testing.assert_close(
        kernel(q, kc, vc, tables, lengths, 0.125),
        reference(q.contiguous(), kc, vc, tables, lengths, 0.125),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="query: expected each token's heads contiguous"):
        kernel(q.transpose(0, 1), kc, vc, tables, lengths, 0.125)


def test_rope_store_equals_the_architectures_rope_and_fills_the_slots(ops) -> None:  # type: ignore[no-untyped-def]
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, dim, bs = 5, 6, 2, 32, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.rand(tokens, dim // 2, generator=g) * 40
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q = qkv[:, : heads * dim].view(1, tokens, heads, dim).transpose(1, 2)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(1, tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim).clone()
    want_q, want_k = apply_rotary_pos_emb(q, k.transpose(1, 2), cos[None], sin[None])
    k_cache, v_cache = torch.zeros(2, 4, bs, kv_heads, dim)
    slots = torch.tensor([13, 2, 7, 0, 15])
    ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads)
    got_q = qkv[:, : heads * dim].view(tokens, heads, dim)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    stored_k = k_cache.view(-1, kv_heads, dim)[slots]
    torch.testing.assert_close(stored_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(16, -1)[untouched].any() and not v_cache.view(16, -1)[untouched].any()
    with pytest.raises(RuntimeError, match=r"slots\[1\] = 16 out of range"):
        ops.rope_store(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 16, 1, 2, 3]), heads)
    with pytest.raises(RuntimeError, match="qkv: expected 384 columns, got 320"):
        ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads + 2)
    with pytest.raises(RuntimeError, match=r"cos, sin: expected \[5, 32\]"):
        ops.rope_store(qkv, cos[:, :16].contiguous(), sin, k_cache, v_cache, slots, heads)


def tiny_engine(version_dir: Path, **llm: object) -> LlmEngine:
    """An engine (not started) on a test model: one thread, 4-token blocks, an 8 MiB pool."""
    opts = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 256,
            "threads": 1, "block_size": 4, **llm}  # fmt: skip
    return LlmEngine("tiny", "1", version_dir, LlmOptions.parse(opts, "test"))


def greedy_tokens(
    version_dir: Path, text: str, n: int, **llm: object
) -> tuple[LlmEngine, list[list[int]]]:
    """24 greedy tokens for each of ``n`` prompts (``text`` repeated 1..n times), generated
    concurrently by an engine with the llm options ``llm``; the engine, stopped."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    e = tiny_engine(version_dir, **llm)
    e.start()
    prompts = [e.encode_text(text * (1 + i)) for i in range(n)]

    async def one(ids: list[int]) -> list[int]:
        return [t async for ev in e.generate(ids, params) for t in ev.token_ids]

    async def go() -> list[list[int]]:
        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await e.stop()

    return e, asyncio.run(go())


def test_engine_gives_the_same_tokens_on_either_attention(kernel, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    version_dir = build_llm(tmp_path, name="tiny", arch="llama")
    text = "the cat sat on the mat "
    used, with_kernel = greedy_tokens(version_dir, text, 6, cpu_attention="kernel")
    unused, with_torch = greedy_tokens(version_dir, text, 6, cpu_attention="torch")
    assert used.runner.decode_kernel is not None and unused.runner.decode_kernel is None
    assert with_kernel == with_torch
    assert all(len(t) == 24 for t in with_kernel)


def test_cpu_attention_option_is_checked() -> None:
    assert LlmOptions.parse({}, "m").cpu_attention == "kernel"
    with pytest.raises(ConfigError, match="llm.cpu_attention: expected kernel or torch"):
        LlmOptions.parse({"cpu_attention": "fast"}, "m")


@pytest.fixture(scope="module")
def ops(kernel):  # type: ignore[no-untyped-def]
    found = kernels.fused_ops()
    assert found is not None
    return found


def packed_logits(model, ids: list[int], kernel, prompt: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The model's logits over ``ids`` run as the engine runs them: the first ``prompt``
    tokens as one prompt chunk, then one decode step per token, keys and values in a pool
    of 4-token blocks (block i holds tokens 4i..4i+3)."""
    from rtserve.runtime.llm import attention
    from rtserve.runtime.llm.attention import Chunk, StepContext

    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    layers, kvh = config.num_hidden_layers, config.num_key_value_heads
    k_cache = [torch.zeros(8, 4, kvh, dim) for _ in range(layers)]
    v_cache = [torch.zeros(8, 4, kvh, dim) for _ in range(layers)]
    steps: list[tuple[list[int], StepContext]] = [
        (list(range(prompt)),
         StepContext(k_cache, v_cache, torch.arange(prompt), 0, None, None,
                     [Chunk(0, prompt, prompt, None, None)]))
    ]  # fmt: skip
    for p in range(prompt, len(ids)):
        table = torch.arange(p // 4 + 1)[None]
        steps.append(
            ([p], StepContext(k_cache, v_cache, torch.tensor([p]), 1, table, None, [],
                              torch.tensor([p + 1]), kernel))
        )  # fmt: skip
    rows = []
    for positions, ctx in steps:
        attention.set_step(ctx)
        try:
            out = model(input_ids=torch.tensor([[ids[p] for p in positions]]),
                        position_ids=torch.tensor([positions]), use_cache=False)  # fmt: skip
        finally:
            attention.set_step(None)
        rows.append(out.logits[0])
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-mlp-bias"])
def test_fused_modules_equal_the_architectures_modules(ops, kernel, arch: str) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from rtserve.runtime.llm.runner import (
        FusedAttention,
        FusedDecoderLayer,
        FusedMLP,
        FusedRMSNorm,
        fuse_modules,
    )

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "llama-mlp-bias": LlamaConfig}[arch]
    extra = {"mlp_bias": True} if arch == "llama-mlp-bias" else {}
    config = cls(num_hidden_layers=2, hidden_size=128, intermediate_size=160,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=300, **extra)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    layer = model.model.layers[0]
    with torch.no_grad():  # (random, not the initial ones: the norm's weight starts at 1)
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        if extra:
            assert layer.mlp.gate_proj.bias is not None
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.bias.uniform_(-0.5, 0.5)
    x = torch.randn(1, 37, 128) * 3
    with torch.no_grad():
        want_norm, want_mlp = layer.input_layernorm(x), layer.mlp(x)
        for hint in (None, 32):  # F.linear, and oneDNN's prepacked weights
            got_norm = FusedRMSNorm(layer.input_layernorm, ops)(x)
            got_mlp = FusedMLP(layer.mlp, ops, hint)(x)
            torch.testing.assert_close(got_norm, want_norm, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_mlp, want_mlp, rtol=1e-4, atol=1e-5)
        # every norm (2 per layer and the final one), MLP and attention is swapped; the model
        # run as the engine runs it (a prompt chunk, then decodes on the kernel) gives the
        # logits the architecture's own modules give over the whole text
        ids = [1, 5, 9, 200, 7, 42, 13, 250, 3, 77]
        want = model(torch.tensor([ids])).logits[0]
        assert fuse_modules(model, ops, 32) == 2 * 4 + 1
        assert isinstance(model.model.norm, FusedRMSNorm)
        assert isinstance(model.model.layers[1].mlp, FusedMLP)
        assert isinstance(model.model.layers[1].self_attn, FusedAttention)
        assert isinstance(model.model.layers[1], FusedDecoderLayer)
        got = packed_logits(model, ids, kernel, prompt=6)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fused_kernels_refuse_what_they_cannot_run(ops) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="weight: expected 8 values, got 4"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="x: expected CPU float32"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up: expected an even number of columns"):
        ops.silu_mul(torch.zeros(2, 7))
    big = torch.tensor([[-200.0, 0.0, 200.0, 1.0, 1.0, 1.0]])  # exp over- and underflow
    torch.testing.assert_close(ops.silu_mul(big), F.silu(big[:, :3]) * big[:, 3:])


def test_gpt2_keeps_its_own_modules(ops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from rtserve.runtime.llm.runner import ModelRunner

    version_dir = build_llm(tmp_path, name="g", arch="gpt2")
    opts = LlmOptions.parse({"device": "cpu", "kv_cache_bytes": 1 << 20}, "test")
    assert ModelRunner(version_dir, opts).fused == 0  # LayerNorm and GELU: nothing to fuse


def test_engine_gives_the_same_tokens_with_fused_kernels_or_not(ops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    version_dir = build_llm(tmp_path, name="tiny", arch="qwen2")
    text = "a dog ran to the park "
    swapped, with_fused = greedy_tokens(version_dir, text, 5, cpu_fused=True)
    none, without = greedy_tokens(version_dir, text, 5, cpu_fused=False)
    # 2 layers x (2 norms + MLP + attention) + the final norm
    assert swapped.runner.fused == 2 * 4 + 1 and none.runner.fused == 0
    assert with_fused == without


def test_cpu_fused_option_is_checked() -> None:
    assert LlmOptions.parse({}, "m").cpu_fused is True
    assert LlmOptions.parse({"cpu_fused": False}, "m").cpu_fused is False
    with pytest.raises(ConfigError, match="llm.cpu_fused: expected true or false"):
        LlmOptions.parse({"cpu_fused": "yes"}, "m")


def test_screened_head_gives_fp32s_argmax_and_exact_rows(ops) -> None:  # type: ignore[no-untyped-def]
    from rtserve.runtime.llm.runner import PackedLinear, ScreenedHead

    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("no AVX512-BF16 on this CPU: the head stays FP32")
    g = torch.Generator().manual_seed(11)
    vocab, hidden, rows = 5000, 96, 24
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.3)
    h = torch.randn(1, rows, hidden, generator=g) * 4
    # near ties that bfloat16 cannot tell apart: row 0's best column and a copy of it that
    # scores 1e-4 higher in FP32; row 1's two best differ by one FP32 ulp-sized step
    with torch.no_grad():
        best = int((h[0, 0] @ head.weight.t()).argmax())
        twin = (best + 1) % vocab
        head.weight[twin] = head.weight[best] + 1e-4 * h[0, 0] / h[0, 0].norm() ** 2
    screened = ScreenedHead(head, ops, 32)
    want = PackedLinear(head, 32)(h[0])
    screened.exact_rows = [3, 7]
    got = screened(h)[0]
    assert got.shape == (rows, vocab)
    assert torch.equal(got.argmax(1), want.argmax(1))
    assert int(got[0].argmax()) == twin
    assert torch.equal(got[[3, 7]], want[[3, 7]])  # every logit, as the FP32 head gives it
    screened.exact_rows = None  # all rows exact
    assert torch.equal(screened(h)[0], want)
    # a non-finite hidden state falls back to the FP32 head rather than guessing
    bad = h.clone()
    bad[0, 2, 0] = float("nan")
    screened.exact_rows = []
    torch.testing.assert_close(screened(bad)[0], PackedLinear(head, 32)(bad[0]), equal_nan=True)
    assert screened(torch.zeros(1, 0, hidden)).shape == (1, 0, vocab)  # nothing sampled
    approx = torch.zeros(2, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="hnorm, wnorm: expected 2 and 4 values"):
        ops.screen_logits(approx, torch.ones(3), torch.ones(4), 0.01, 2.0**-8)


def test_engine_with_a_screened_head_samples_as_the_fp32_head(ops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Greedy rows, seeded sampled rows and logprobs in one batch: the same tokens and
    log-probabilities whether the head screens in bfloat16 or runs in FP32."""
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("no AVX512-BF16 on this CPU: the head stays FP32")
    version_dir = build_llm(tmp_path, name="tiny", arch="llama")
    mixed = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.2, top_k=5, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    ]

    def run(screen: bool) -> list[list[tuple[int, float | None]]]:
        e = tiny_engine(version_dir)
        head = e.runner.screened_head
        assert head is not None
        if not screen:  # the same prepacked FP32 head, every row exact
            e.runner.model.lm_head = head.exact
            e.runner.screened_head = None
        e.start()

        async def one(i: int, p: SamplingParams) -> list[tuple[int, float | None]]:
            ids = e.encode_text("the cat sat on the mat " * (i + 1))
            out: list[tuple[int, float | None]] = []
            async for ev in e.generate(ids, p):
                lps = ev.logprobs or [None] * len(ev.token_ids)
                out.extend((t, None if lp is None else lp.logprob)
                           for t, lp in zip(ev.token_ids, lps, strict=True))  # fmt: skip
            return out

        async def go() -> list[list[tuple[int, float | None]]]:
            try:
                return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(mixed))))
            finally:
                await e.stop()

        return asyncio.run(go())

    screened, plain = run(True), run(False)
    assert [len(s) for s in screened] == [20] * len(mixed)
    assert [[t for t, _ in s] for s in screened] == [[t for t, _ in s] for s in plain]
    for row in (2, 3):  # logprobs: top 2, and the chosen token's only
        for got, want in zip(screened[row], plain[row], strict=True):
            assert got[1] is not None and want[1] is not None
            assert got[1] == pytest.approx(want[1], abs=1e-5)
