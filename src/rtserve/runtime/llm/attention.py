"""Paged attention for a packed step, plugged into transformers' attention interface.

One step runs every scheduled sequence's new tokens as one packed row (no padding in the
projections and MLPs): first the single-token items (decodes), then the prompt chunks. The
architecture's own attention module computes q/k/v and the rotary or absolute positions;
this function stores the new keys and values in the block pool at their slots and attends
each item to its sequence's cached context.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rtserve.errors import ConfigError

ATTN_NAME = "rtserve_paged"
_local = threading.local()


@dataclass(slots=True)
class Chunk:
    """A prompt chunk of ``n`` tokens at packed offset ``start``; its sequence holds
    ``context`` tokens after this step; ``gather``: its block table (None when the chunk is
    the whole context: it attends to itself only), ``mask`` [n, blocks * block_size]."""

    start: int
    n: int
    context: int
    gather: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class StepContext:
    """What the attention of every layer needs for the current step."""

    k_cache: list[torch.Tensor]  # per layer: [blocks, block_size, kv_heads, head_dim]
    v_cache: list[torch.Tensor]
    slots: torch.Tensor  # [T]: where each packed token's key/value goes
    decodes: int  # the first ``decodes`` packed tokens are single-token items
    decode_gather: torch.Tensor | None  # [decodes, B]: their block tables (padded)
    decode_mask: torch.Tensor | None  # [decodes, 1, 1, B * block_size] (torch's path only)
    chunks: list[Chunk]
    decode_lengths: torch.Tensor | None = None  # [decodes]: their context lengths
    decode_kernel: Callable[..., torch.Tensor] | None = None  # kernels.paged_decode
    max_model_len: int = 0  # the longest context (sliding windows must not be shorter)


def set_step(ctx: StepContext | None) -> None:
    _local.step = ctx


def current() -> StepContext:
    """The step being run (``set_step``)."""
    return _local.step  # type: ignore[no-any-return]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """``query`` [1, H, T, D], ``key``/``value`` [1, KVH, T, D] for the packed step; returns
    [1, T, H, D] as transformers' attention functions do."""
    ctx: StepContext = _local.step
    if kwargs:
        check_options(ctx, kwargs)
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    keys, values = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, D]
    k_cache.view(-1, kv_heads, dim).index_copy_(0, ctx.slots, keys)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, ctx.slots, values)
    softcap = kwargs.get("softcap")
    q = query[0].transpose(0, 1)
    if softcap is not None:
        out = attend_softcapped(ctx, layer, q, keys, values, scaling, float(softcap))  # type: ignore[arg-type]
    else:
        out = attend(ctx, layer, q, keys, values, scaling)
    return out.unsqueeze(0), None


# Keyword arguments architectures pass to the attention function that change its result
# and are not handled here (gpt-oss's attention sinks): a model passing one is refused.
_UNSUPPORTED = ("s_aux", "sinks")


def check_options(ctx: StepContext, kwargs: dict[str, object]) -> None:
    """Refuse what this attention would get wrong: a sliding window shorter than the
    longest context (the runner caps ``max_model_len`` at the window, inside which full
    attention is exact), soft-capping where the decode kernel would skip it, sinks."""
    window = kwargs.get("sliding_window")
    if isinstance(window, int) and window < ctx.max_model_len:
        raise ConfigError(
            f"llm: the model attends within a sliding window of {window} tokens, shorter "
            f"than max_model_len {ctx.max_model_len}; set llm.max_model_len <= {window}"
        )
    if kwargs.get("softcap") is not None and ctx.decode_kernel is not None and ctx.decodes:
        raise ConfigError("llm: attention soft-capping needs llm.cpu_attention: torch")
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ConfigError(f"llm: this model's attention uses {name!r}, not supported")


def attend_softcapped(
    ctx: StepContext,
    layer: int,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    """``attend`` with the scores soft-capped (``cap * tanh(score / cap)``, Gemma 2) before
    the softmax, computed in plain PyTorch; [T, H, D]."""
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    tokens, heads = q.shape[0], q.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    out = q.new_empty(tokens, heads, dim)
    nd = ctx.decodes
    if nd:
        table, mask = ctx.decode_gather, ctx.decode_mask
        assert table is not None and mask is not None
        width = table.shape[1] * k_cache.shape[1]
        keys = k_cache.index_select(0, table.view(-1)).view(nd, width, kv_heads, dim)
        values = v_cache.index_select(0, table.view(-1)).view(nd, width, kv_heads, dim)
        out[:nd] = _capped(
            q[:nd].unsqueeze(2), keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3),
            mask, scale, softcap,
        ).squeeze(2)  # fmt: skip
    for c in ctx.chunks:
        qc = q[c.start : c.start + c.n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if c.gather is None:
            kc = key[c.start : c.start + c.n].transpose(0, 1).unsqueeze(0)
            vc = value[c.start : c.start + c.n].transpose(0, 1).unsqueeze(0)
            mask = torch.ones(c.n, c.n, dtype=torch.bool, device=q.device).tril()
        else:
            kc = k_cache.index_select(0, c.gather).view(1, -1, kv_heads, dim).transpose(1, 2)
            vc = v_cache.index_select(0, c.gather).view(1, -1, kv_heads, dim).transpose(1, 2)
            assert c.mask is not None
            mask = c.mask
        out[c.start : c.start + c.n] = _capped(qc, kc, vc, mask, scale, softcap)[0].transpose(0, 1)
    return out


def _capped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Soft-capped attention: ``q`` [N, H, n, D], ``k``/``v`` [N, KVH, L, D], ``mask`` (True:
    attend) broadcastable to [N, H, n, L]; [N, H, n, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def attend(
    ctx: StepContext,
    layer: int,
    q: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of the packed step's queries ``q`` [T, H, D] to their sequences' contexts,
    this step's keys and values (``key``/``value`` [T, KVH, D]; needed only when the step
    has prompt chunks) already in the pool; [T, H, D]."""
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    tokens, heads = q.shape[0], q.shape[1]
    groups = heads // kv_heads
    nd = ctx.decodes
    decoded: torch.Tensor | None = None
    if nd:
        qd = q[:nd]
        kernel = ctx.decode_kernel
        if kernel is not None:  # in place over the pool: no gathered copy, no padding
            if qd.stride(2) != 1 or qd.stride(1) != dim:
                qd = qd.contiguous()
            decoded = kernel(
                qd, k_cache, v_cache, ctx.decode_gather, ctx.decode_lengths,
                scaling if scaling is not None else dim**-0.5,
            )  # fmt: skip
        else:
            decoded = _gathered_decode(ctx, qd, k_cache, v_cache, scaling)
        if nd == tokens:
            return decoded
    out = q.new_empty(tokens, heads, dim)
    if decoded is not None:
        out[:nd] = decoded
    for c in ctx.chunks:
        qc = q[c.start : c.start + c.n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if c.gather is None:
            assert key is not None and value is not None
            kc = key[c.start : c.start + c.n].transpose(0, 1).unsqueeze(0)
            vc = value[c.start : c.start + c.n].transpose(0, 1).unsqueeze(0)
            oc = F.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, scale=scaling, enable_gqa=groups > 1
            )
        else:
            kc = k_cache.index_select(0, c.gather).view(1, -1, kv_heads, dim).transpose(1, 2)
            vc = v_cache.index_select(0, c.gather).view(1, -1, kv_heads, dim).transpose(1, 2)
            oc = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=c.mask, scale=scaling, enable_gqa=groups > 1
            )
        out[c.start : c.start + c.n] = oc[0].transpose(0, 1)
    return out


def _gathered_decode(
    ctx: StepContext,
    qd: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """PyTorch's decode attention: each sequence's blocks gathered (padded to the widest
    table) and masked; [nd, H, D]."""
    nd, heads, dim = qd.shape
    _, block_size, kv_heads, _ = k_cache.shape
    table = ctx.decode_gather
    assert table is not None
    width = table.shape[1] * block_size
    keys = k_cache.index_select(0, table.view(-1)).view(nd, width, kv_heads, dim)
    values = v_cache.index_select(0, table.view(-1)).view(nd, width, kv_heads, dim)
    # Every head of a kv head's group attends at the same position: one query row each.
    od = F.scaled_dot_product_attention(
        qd.reshape(nd, kv_heads, heads // kv_heads, dim),
        keys.permute(0, 2, 1, 3),
        values.permute(0, 2, 1, 3),
        attn_mask=ctx.decode_mask,
        scale=scaling,
    )  # [nd, KVH, groups, D]
    return od.reshape(nd, heads, dim)


def register() -> None:
    """Make ``ATTN_NAME`` an attention implementation transformers models can select (no
    mask is built for it: this function knows each item's context)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
