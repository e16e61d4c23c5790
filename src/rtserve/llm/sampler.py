"""The next token of each sequence from its logits: greedy rows in one argmax, sampled
rows with their own temperature, top-k, top-p and random generator (a ``seed`` makes a
sequence reproducible whatever else shares its batch)."""

from __future__ import annotations

import torch

from rtserve.llm.params import SamplingParams, TokenLogprob
from rtserve.llm.tokens import TokenBytes


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)
    else:
        g.seed()
    return g


def _sample_row(logits: torch.Tensor, p: SamplingParams, g: torch.Generator | None) -> int:
    scores = logits.float() / p.temperature
    if p.top_k > 0 and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs >= p.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        # logits the model made non-finite: this row's most likely token, never an error
        # that would fail every sequence in the step
        return int(torch.argmax(torch.nan_to_num(logits.float(), nan=float("-inf"))).item())
    return int(torch.multinomial(probs, 1, generator=g).item())


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` [rows, vocab]."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [
        greedy[i] if p.greedy else _sample_row(logits[i], p, generators[i])
        for i, p in enumerate(params)
    ]


def logprobs_of(
    logits: torch.Tensor, token: int, top: int, texts: TokenBytes, offset: int = 0
) -> TokenLogprob:
    """The chosen token's log-probability under the model and the ``top`` most likely;
    ``offset``: where the token's text starts."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return _entry(lp, token, top, texts, offset)


def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], top: int, texts: TokenBytes
) -> list[TokenLogprob]:
    """Each row of ``logits`` [rows, vocab] scoring the token that follows it (``targets``)
    and the ``top`` most likely there (offsets are set by the caller)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [_entry(lp[i], t, top, texts, 0) for i, t in enumerate(targets)]


def _entry(lp: torch.Tensor, token: int, top: int, texts: TokenBytes, offset: int) -> TokenLogprob:
    alternatives: list[tuple[str, float]] = []
    raws: list[bytes] = []
    if top:
        values, ids = torch.topk(lp, top)
        for v, i in zip(values.tolist(), ids.tolist(), strict=True):
            text, raw = texts(i)
            alternatives.append((text, float(v)))
            raws.append(raw)
    text, raw = texts(token)
    return TokenLogprob(text, float(lp[token]), alternatives, raw, raws, offset)
