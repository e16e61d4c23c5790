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
from rtserve.llm import kernels  # noqa: E402
from rtserve.llm.engine import LlmEngine  # noqa: E402
from rtserve.llm.options import LlmOptions  # noqa: E402
from rtserve.llm.params import SamplingParams  # noqa: E402
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


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(6, 2, 32), (4, 4, 64), (9, 3, 64), (4, 2, 128), (2, 1, 80)]
)
def test_kernel_equals_torch_attention_over_gathered_blocks(
    kernel, heads: int, kv_heads: int, dim: int
) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(heads * dim)
    blocks, bs, nd, width = 64, 4, 7, 9
    kc = torch.randn(blocks, bs, kv_heads, dim, generator=g)
    vc = torch.randn(blocks, bs, kv_heads, dim, generator=g)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(nd)])
    lengths = torch.tensor([1, 2, 5, 17, 30, 35, 36])  # 1 token .. every slot of the table
    q = torch.randn(nd, heads, dim, generator=g)
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


def greedy_tokens(
    version_dir: Path, text: str, n: int, **llm: object
) -> tuple[LlmEngine, list[list[int]]]:
    """24 greedy tokens for each of ``n`` prompts (``text`` repeated 1..n times), generated
    concurrently by an engine with the llm options ``llm``; the engine, stopped."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    opts = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 256,
            "threads": 1, "block_size": 4, **llm}  # fmt: skip
    e = LlmEngine("tiny", "1", version_dir, LlmOptions.parse(opts, "test"))
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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-mlp-bias"])
def test_fused_norm_and_mlp_equal_the_architectures_modules(ops, arch: str) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from rtserve.llm.runner import FusedMLP, FusedRMSNorm, fuse_modules

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "llama-mlp-bias": LlamaConfig}[arch]
    extra = {"mlp_bias": True} if arch == "llama-mlp-bias" else {}
    config = cls(num_hidden_layers=2, hidden_size=96, intermediate_size=160,
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
    x = torch.randn(1, 37, 96) * 3
    with torch.no_grad():
        want_norm, want_mlp = layer.input_layernorm(x), layer.mlp(x)
        for hint in (None, 32):  # F.linear, and oneDNN's prepacked weights
            got_norm = FusedRMSNorm(layer.input_layernorm, ops)(x)
            got_mlp = FusedMLP(layer.mlp, ops, hint)(x)
            torch.testing.assert_close(got_norm, want_norm, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_mlp, want_mlp, rtol=1e-4, atol=1e-5)
        # every norm (2 per layer and the final one) and MLP of the model is swapped
        logits = model(torch.tensor([[1, 5, 9, 200]])).logits
        assert fuse_modules(model, ops, 32) == 2 * 3 + 1
        assert isinstance(model.model.norm, FusedRMSNorm)
        assert isinstance(model.model.layers[1].mlp, FusedMLP)
        torch.testing.assert_close(model(torch.tensor([[1, 5, 9, 200]])).logits, logits,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip


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
    from rtserve.llm.runner import ModelRunner

    version_dir = build_llm(tmp_path, name="g", arch="gpt2")
    opts = LlmOptions.parse({"device": "cpu", "kv_cache_bytes": 1 << 20}, "test")
    assert ModelRunner(version_dir, opts).fused == 0  # LayerNorm and GELU: nothing to fuse


def test_engine_gives_the_same_tokens_with_fused_kernels_or_not(ops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    version_dir = build_llm(tmp_path, name="tiny", arch="qwen2")
    text = "a dog ran to the park "
    swapped, with_fused = greedy_tokens(version_dir, text, 5, cpu_fused=True)
    none, without = greedy_tokens(version_dir, text, 5, cpu_fused=False)
    # 2 layers x (2 norms + MLP) + the final norm
    assert swapped.runner.fused == 2 * 3 + 1 and none.runner.fused == 0
    assert with_fused == without


def test_cpu_fused_option_is_checked() -> None:
    assert LlmOptions.parse({}, "m").cpu_fused is True
    assert LlmOptions.parse({"cpu_fused": False}, "m").cpu_fused is False
    with pytest.raises(ConfigError, match="llm.cpu_fused: expected true or false"):
        LlmOptions.parse({"cpu_fused": "yes"}, "m")
