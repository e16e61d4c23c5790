"""Speculative decoding: draft a few tokens per decoding sequence, verify them all in one
forward of the model, keep the longest run the model agrees with plus one token of its own.

Drafts come from the sequence's own text (prompt lookup: the tokens that followed the
latest earlier occurrence of its last n-gram) or from a draft model of the repository with
the same tokenizer. Verification keeps the output exactly what plain decoding gives: greedy
sequences keep a draft token while it is the model's argmax, then add the argmax where they
part; sampled sequences use rejection sampling (a draft token ``d`` drafted with probability
``q(d)`` is kept with probability ``min(1, p(d) / q(d))``, else a token is drawn from
``max(p - q, 0)`` normalised), which leaves each token's distribution the model's own
(prompt lookup drafts deterministically: ``q`` is one-hot).

The functions here are pure (lists and tensors in, tokens out); the engine calls them.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rtserve.errors import ConfigError
from rtserve.llm.options import SpeculativeOptions
from rtserve.llm.params import SamplingParams

log = logging.getLogger(__name__)

LOOKUP_WINDOW = 8192  # prompt lookup searches the last this many tokens


def propose_ngram(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``tokens`` of ``ngram_max`` down to ``ngram_min`` tokens ([] if none occurs)."""
    if k <= 0 or len(tokens) <= ngram_min:
        return []
    arr = np.asarray(tokens[-LOOKUP_WINDOW:], dtype=np.int64)
    n_tok = len(arr)
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        pattern = arr[-n:]
        # windows that end before the last token: the suffix itself is not a match
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()  # type: ignore[no-any-return]
    return []


def verify_greedy(draft: list[int], argmax: list[int]) -> list[int]:
    """The tokens greedy decoding makes: ``argmax[j]`` is the model's choice after draft
    token ``j`` (``argmax[0]``: after the last token before the drafts); len(draft) + 1."""
    out: list[int] = []
    for d, best in zip(draft, argmax, strict=False):
        if d != best:
            break
        out.append(d)
    out.append(argmax[len(out)])
    return out


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution ``sampler.sample`` draws from for each row of ``logits`` [R, V]
    (temperature, then top-k, then top-p); a row the model made non-finite: one-hot on its
    most likely token, as the sampler does."""
    scores = logits.float() / p.temperature
    vocab = scores.shape[-1]
    if 0 < p.top_k < vocab:
        kth = torch.topk(scores, p.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        sorted_probs = sorted_probs.masked_fill(cumulative - sorted_probs >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    for r in range(probs.shape[0]):
        row = probs[r]
        if not bool(torch.isfinite(row).all()) or float(row.sum()) <= 0.0:
            best = torch.argmax(torch.nan_to_num(logits[r].float(), nan=float("-inf")))
            probs[r] = 0.0
            probs[r, best] = 1.0
    return probs


def verify_sampled(
    draft: list[int],
    target: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """Rejection sampling: ``target`` [len(draft) + 1, V] the model's distributions (row j:
    after draft token j, row 0 after the last token before them); ``draft_probs``
    [len(draft), V'] (V' <= V) the distributions the drafts were drawn from (None: each draft
    token was certain, as prompt lookup's are). Each token returned is distributed as the
    model alone would draw it."""
    out: list[int] = []
    vocab = target.shape[-1]
    for j, d in enumerate(draft):
        p = target[j]
        if draft_probs is None:
            q_d = 1.0
        else:
            q_d = float(draft_probs[j, d]) if d < draft_probs.shape[-1] else 0.0
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_d > 0.0 and u * q_d < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        if draft_probs is None:
            residual[d] = 0.0
        else:
            q = torch.zeros(vocab, dtype=residual.dtype, device=residual.device)
            q[: draft_probs.shape[-1]] = draft_probs[j]
            residual = torch.clamp(residual - q, min=0.0)
        if float(residual.sum()) <= 0.0:  # (p == q: any draw from p is right)
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target[len(draft)], 1, generator=generator)))
    return out


# ------------------------------------------------------------------- the draft model
def resolve_draft(version_dir: Path, spec: SpeculativeOptions, tokenizer: Any, vocab: int) -> Path:
    """The newest version directory of ``spec.draft_model`` beside this model in the
    repository, checked: it exists, has this model's tokenizer, and no larger vocabulary.
    Errors name the config file and the field."""
    field_name = f"{spec.source}: llm.speculative.draft_model"
    root = version_dir.resolve().parent.parent
    name = spec.draft_model
    model_dir = root / name
    if "/" in name or name in ("", ".", "..") or not model_dir.is_dir():
        raise ConfigError(
            f"{field_name}: no model {name!r} in the repository {root} (expected "
            f"{root}/{name}/<version>/ with a Hugging Face causal LM)"
        )
    versions = sorted(
        (int(d.name), d)
        for d in model_dir.iterdir()
        if d.name.isdigit() and (d / "config.json").is_file()
    )
    if not versions:
        raise ConfigError(
            f"{field_name}: {model_dir} has no version directory with a config.json "
            f"(expected {model_dir}/<version>/config.json)"
        )
    draft_dir = versions[-1][1]
    from transformers import AutoConfig, AutoTokenizer

    try:
        draft_tok = AutoTokenizer.from_pretrained(draft_dir)
        config = AutoConfig.from_pretrained(draft_dir)
    except Exception as exc:
        raise ConfigError(f"{field_name}: {draft_dir} does not load: {exc}") from exc
    if draft_tok.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"{field_name}: {name!r} has another tokenizer than this model (expected the "
            f"same vocabulary, token for token: its drafts are token ids of this model)"
        )
    draft_vocab = int(getattr(config, "vocab_size", 0) or 0)
    if draft_vocab > vocab:
        raise ConfigError(
            f"{field_name}: {name!r} has a larger vocabulary ({draft_vocab}) than this "
            f"model ({vocab}); expected at most {vocab}"
        )
    return draft_dir


@dataclass(slots=True)
class _DraftState:
    cache: Any  # transformers' DynamicCache
    ids: list[int] = field(default_factory=list)  # the tokens whose keys/values it holds


class DraftModel:
    """A small causal LM that drafts for the sequences, one transformers key/value cache
    per sequence (outside the KV pool; cut back to the tokens kept after each step, dropped
    when the sequence ends or is preempted)."""

    def __init__(self, draft_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(
            draft_dir, dtype=dtype, attn_implementation="sdpa"
        )
        self.model = model.to(device).eval()
        self.device = device
        self.states: dict[int, _DraftState] = {}
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    @torch.inference_mode()
    def propose(
        self,
        seq_id: int,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """``k`` tokens drafted after ``tokens`` (and, sampling, the distributions they were
        drawn from [k, V'])."""
        from transformers import DynamicCache

        state = self.states.get(seq_id)
        if state is None:
            state = self.states[seq_id] = _DraftState(DynamicCache())
        keep = 0
        for a, b in zip(state.ids, tokens[:-1], strict=False):  # (the last one runs again)
            if a != b:
                break
            keep += 1
        if keep == 0 and state.ids:
            state = self.states[seq_id] = _DraftState(DynamicCache())
        elif keep < len(state.ids):
            state.cache.crop(keep - len(state.ids))  # (negative: remove that many)
            del state.ids[keep:]
        new = tokens[keep:]
        draft: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            out = self.model(
                input_ids=torch.tensor([new], device=self.device),
                use_cache=True,
                **{self._cache_arg: state.cache},
            )
            state.ids.extend(new)
            logits = out.logits[0, -1:].float()
            if params.greedy:
                token = int(torch.argmax(logits[0]))
            else:
                probs = probabilities(logits, params)
                rows.append(probs[0])
                token = int(torch.multinomial(probs[0], 1, generator=generator))
            draft.append(token)
            new = [token]
        return draft, (torch.stack(rows) if rows else None)


class Speculator:
    """What the engine drafts with: prompt lookup or a draft model, per ``llm.speculative``."""

    def __init__(
        self,
        spec: SpeculativeOptions,
        version_dir: Path,
        tokenizer: Any,
        vocab: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.spec = spec
        self.draft: DraftModel | None = None
        if spec.method == "draft":
            draft_dir = resolve_draft(version_dir, spec, tokenizer, vocab)
            self.draft = DraftModel(draft_dir, device, dtype)
            log.info("llm %s: drafts from %s", version_dir, draft_dir)

    @property
    def max_batch(self) -> int:
        return self.spec.max_batch

    def propose(
        self,
        seq_id: int,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> tuple[list[int], torch.Tensor | None]:
        if self.draft is not None:
            return self.draft.propose(seq_id, tokens, k, params, generator)
        return propose_ngram(tokens, k, self.spec.ngram_min, self.spec.ngram_max), None

    def forget(self, seq_id: int) -> None:
        if self.draft is not None:
            self.draft.forget(seq_id)
