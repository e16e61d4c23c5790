"""The CPU paged-attention kernel (llm/csrc/paged_attention.cpp) against PyTorch's own
attention over gathered blocks, its checks on hostile tables, and the engine on either path."""

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


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 32), (4, 4, 64), (9, 3, 64)])
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


def test_engine_gives_the_same_tokens_on_either_attention(kernel, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    version_dir = build_llm(tmp_path, name="tiny", arch="llama")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def generate(cpu_attention: str) -> tuple[bool, list[list[int]]]:
        opts = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 256,
                "threads": 1, "block_size": 4, "cpu_attention": cpu_attention}  # fmt: skip
        e = LlmEngine("tiny", "1", version_dir, LlmOptions.parse(opts, "test"))
        e.start()
        prompts = [e.encode_text("the cat sat on the mat " * (1 + i)) for i in range(6)]

        async def one(ids: list[int]) -> list[int]:
            return [t async for ev in e.generate(ids, params) for t in ev.token_ids]

        async def go() -> list[list[int]]:
            try:
                return list(await asyncio.gather(*(one(p) for p in prompts)))
            finally:
                await e.stop()

        return e.runner.decode_kernel is not None, asyncio.run(go())

    used, with_kernel = generate("kernel")
    unused, with_torch = generate("torch")
    assert used and not unused
    assert with_kernel == with_torch
    assert all(len(t) == 24 for t in with_kernel)


def test_cpu_attention_option_is_checked() -> None:
    assert LlmOptions.parse({}, "m").cpu_attention == "kernel"
    with pytest.raises(ConfigError, match="llm.cpu_attention: expected kernel or torch"):
        LlmOptions.parse({"cpu_attention": "fast"}, "m")
