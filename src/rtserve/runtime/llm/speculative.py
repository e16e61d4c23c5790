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
from rtserve.runtime.llm.options import SpeculativeOptions
from rtserve.runtime.llm.params import SamplingParams

log = logging.getLogger(__name__)

LOOKUP_WINDOW = 8192  # prompt lookup searches the last this many tokens


MATCH_CAP = 64  # a candidate's match is followed back at most this many tokens
STEP_TOKENS = 16  # tokens a decode step verifies in all (more rows make a step compute-bound)


def matches(tokens: list[int], ngram_min: int) -> tuple[np.ndarray, np.ndarray]:
    """Earlier occurrences of the end of ``tokens`` (within the last ``LOOKUP_WINDOW``): the
    index in ``tokens`` where each one's continuation starts, and how many tokens it matches
    (followed back up to ``MATCH_CAP``); only those of at least ``ngram_min`` tokens."""
    arr = np.asarray(tokens[-LOOKUP_WINDOW:], dtype=np.int64)
    n_tok = len(arr)
    none = np.empty(0, dtype=np.int64)
    if n_tok <= ngram_min:
        return none, none
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # (the suffix itself is not a match)
    length = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, min(MATCH_CAP, n_tok - 1)):
        idx = ends - j
        ok = alive & (idx >= 0)
        if not ok.any():
            break
        ok[ok] = arr[idx[ok]] == arr[n_tok - 1 - j]
        length += ok
        alive = ok
    keep = length >= ngram_min
    return ends[keep] + 1 + (len(tokens) - n_tok), length[keep]


def propose_ngram(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to ``k`` tokens drafted from the sequence's own text (prompt lookup).

    Every earlier occurrence of the last ``ngram_min`` or more tokens is a candidate. The
    draft follows the one whose match is longest (counted up to ``ngram_max``; the latest
    among equals), for at most as many tokens as its full match is long (a long match is
    likely copied text; a two-token one rarely runs on), and stops where the candidates
    still agreeing with the draft part ways (the followed one's continuation weighing less
    than half, each candidate weighted by its match length squared)."""
    if k <= 0:
        return []
    starts, length = matches(tokens, ngram_min)
    if not len(starts):
        return []
    order = np.lexsort((-starts, -np.minimum(length, ngram_max)))
    starts, length = starts[order], length[order]
    k = min(k, int(length[0]))
    arr = np.asarray(tokens, dtype=np.int64)
    weight = length.astype(np.float64) ** 2
    draft: list[int] = []
    for j in range(k):
        pos = starts + j
        live = pos < len(arr)
        if not live[0]:
            break
        starts, weight, pos = starts[live], weight[live], pos[live]
        nxt = arr[pos]
        agree = nxt == nxt[0]
        if j > 0 and weight[agree].sum() < 0.5 * weight.sum():
            break
        draft.append(int(nxt[0]))
        starts, weight = starts[agree], weight[agree]
    return draft


def draft_tokens(
    num_tokens: int, decoding: int, max_batch: int, step_tokens: int = STEP_TOKENS
) -> int:
    """Tokens drafted per sequence while ``decoding`` sequences decode: each verifies its
    drafts and its own token in the step, up to ``step_tokens`` tokens in all (a step that
    reads each weight once for a few rows costs about what one row costs; past that, every
    rejected draft is computed for nothing). 0 past ``max_batch`` sequences."""
    if decoding > max_batch or decoding <= 0:
        return 0
    return max(0, min(num_tokens, step_tokens // decoding - 1))


def replay(
    prompt: list[int], output: list[int], k: int, ngram_min: int, ngram_max: int
) -> tuple[int, int, int]:
    """Prompt lookup replayed on a greedy ``output`` of ``prompt`` (greedy speculation
    yields the same tokens): steps (the prefill's, which makes the first token, included),
    tokens drafted, tokens accepted, as one sequence decoding alone with ``k`` drafts a
    step would count them."""
    steps, drafted, accepted = 1, 0, 0
    at = 1
    while at < len(output):
        draft = propose_ngram(
            prompt + output[:at], min(k, len(output) - at - 1), ngram_min, ngram_max
        )
        kept = 0
        for d, t in zip(draft, output[at:], strict=False):
            if d != t:
                break
            kept += 1
        steps, drafted, accepted = steps + 1, drafted + len(draft), accepted + kept
        at += kept + 1
    return steps, drafted, accepted


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
    check_draft(draft_dir, tokenizer, vocab, field_name, name)
    return draft_dir


def check_draft(draft_dir: Path, tokenizer: Any, vocab: int, where: str, name: str) -> None:
    """``draft_dir`` loads and has ``tokenizer``'s vocabulary and at most ``vocab`` tokens;
    errors start with ``where`` and call the draft ``name``."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        draft_tok = AutoTokenizer.from_pretrained(draft_dir)
        config = AutoConfig.from_pretrained(draft_dir)
    except Exception as exc:
        raise ConfigError(f"{where}: {draft_dir} does not load: {exc}") from exc
    if draft_tok.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"{where}: {name!r} has another tokenizer than this model (expected the "
            f"same vocabulary, token for token: its drafts are token ids of this model)"
        )
    draft_vocab = int(getattr(config, "vocab_size", 0) or 0)
    if draft_vocab > vocab:
        raise ConfigError(
            f"{where}: {name!r} has a larger vocabulary ({draft_vocab}) than this "
            f"model ({vocab}); expected at most {vocab}"
        )


def draft_weights(draft_dir: Path) -> str:
    """The draft's ``llm.weights`` (its model's config.yaml; fp32 without one)."""
    import yaml

    from rtserve.runtime.llm.options import WEIGHTS

    path = draft_dir.parent / "config.yaml"
    try:
        config = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: does not load: {exc}") from exc
    llm = config.get("llm") if isinstance(config, dict) else None
    weights = llm.get("weights", "fp32") if isinstance(llm, dict) else "fp32"
    if weights not in WEIGHTS:
        raise ConfigError(
            f"{path}: llm.weights: expected one of {', '.join(WEIGHTS)}, got {weights!r}"
        )
    return str(weights)


@dataclass(slots=True)
class _DraftState:
    cache: Any  # transformers' DynamicCache
    ids: list[int] = field(default_factory=list)  # the tokens whose keys/values it holds


class DraftModel:
    """A small causal LM that drafts for the sequences, one transformers key/value cache
    per sequence (outside the KV pool; cut back to the tokens kept after each step, dropped
    when the sequence ends or is preempted). Its linear layers are in the ``llm.weights``
    of its own config.yaml (``quant``: a model can draft for itself at int4)."""

    def __init__(self, draft_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        weights = draft_weights(draft_dir)
        model: Any = AutoModelForCausalLM.from_pretrained(
            draft_dir, dtype=dtype, attn_implementation="sdpa"
        )
        self.model = model.to(device).eval()
        if weights != "fp32":
            from rtserve.runtime.llm import kernels, quant

            ops = kernels.quant_ops() if device.type == "cpu" else None
            quant.quantize_linears(self.model, weights, ops)
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
        self.step_tokens = STEP_TOKENS  # tokens a step verifies in all (``draft_tokens``)
        self.draft: DraftModel | None = None
        if spec.method == "draft":
            draft_dir = resolve_draft(version_dir, spec, tokenizer, vocab)
            self.draft = DraftModel(draft_dir, device, dtype)
            log.info("llm %s: drafts from %s", version_dir, draft_dir)

    @property
    def max_batch(self) -> int:
        return self.spec.max_batch

    def draft_tokens(self, decoding: int) -> int:
        return draft_tokens(self.spec.num_tokens, decoding, self.spec.max_batch, self.step_tokens)

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
