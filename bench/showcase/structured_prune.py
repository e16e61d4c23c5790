"""The structured-pruning section of the optimization report: all-MiniLM-L6-v2 with attention
heads and FFN neurons cut out (``--prune structured-heads:H:F``), trained layer by layer and
then end to end on the unpruned model's outputs for unlabelled text, alone and stacked with
INT8 dynamic, against FP32 of the same run.

    python -m bench.showcase --only prune --out /tmp/opt-prune.md    # this section alone

Held out: the first :data:`EVAL_SENTENCES` sentences of ``examples/data/sentences.txt``.
Distillation text (no labels; the teacher's embeddings are the targets): the other
sentences, sentences of the Python documentation that ships with the interpreter
(``pydoc_data``), and new sentences made by joining the first half of one training sentence
to the second half of another, up to :data:`TRAIN_TEXTS` texts.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bench.showcase import zoo
from rtserve.optimize.pipeline import (
    OptimizeResult,
    PruneSpec,
    TorchSources,
    ratio,
    run_optimize,
)
from rtserve.optimize.prune_transformer import STRUCTURED_HEADS
from rtserve.optimize.report import markdown_table

if TYPE_CHECKING:
    from bench.showcase.zoo import Settings

GOAL_SPEEDUP = 1.5
GOAL_COSINE = 0.99
EVAL_SENTENCES = 120
TRAIN_TEXTS = 3000
SPEC = PruneSpec(STRUCTURED_HEADS, 0.5, fine_tune_epochs=4, ffn_amount=0.5, fine_tune_seconds=300.0)


def split_sentences(text: str) -> list[str]:
    """``text`` cut after each ``.``, ``!`` or ``?`` that whitespace follows; each sentence's
    whitespace runs become single spaces."""
    return [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+", text)]


def python_doc_sentences() -> list[str]:
    """Plain-prose sentences of the Python reference documentation bundled with CPython."""
    import pydoc_data.topics

    sentences = split_sentences(" ".join(pydoc_data.topics.topics.values()))
    return [
        s
        for s in sentences
        if 30 < len(s) < 200 and sum(c.isalpha() or c == " " for c in s) > 0.9 * len(s)
    ]


def training_texts(sentences: Sequence[str], count: int, seed: int = 0) -> list[str]:
    """``sentences``, then documentation sentences, then half-and-half joins, ``count`` in all."""
    rng = random.Random(seed)
    texts = list(sentences) + python_doc_sentences()
    words = [s.split() for s in sentences]
    while len(texts) < count:
        a, b = rng.choice(words), rng.choice(words)
        texts.append(" ".join(a[: len(a) // 2] + b[len(b) // 2 :]))
    return texts[:count]


def run(settings: Settings) -> OptimizeResult:
    """Export MiniLM, build and measure INT8 dynamic, the pruned model and pruned + INT8."""
    from bench.showcase.zoo import SENTENCES, options
    from rtserve.optimize.data import read_sentences

    work = settings.work / "minilm-prune"
    model = zoo.export_minilm(work / "source.onnx", seq_len=32)
    sentences = read_sentences(SENTENCES)
    eval_data = zoo.minilm_tokenize(sentences[:EVAL_SENTENCES], seq_len=32)
    train = zoo.minilm_tokenize(training_texts(sentences[EVAL_SENTENCES:], TRAIN_TEXTS), 32)
    sources = TorchSources(model=zoo.minilm_module(), train_inputs=train, prune=[SPEC])
    opts = options(
        settings, max_accuracy_drop=1 - GOAL_COSINE, variants=("fp32-opt", "int8-dynamic", "pruned"),
        task="embedding", num_heads=12, hidden_size=384,
    )  # fmt: skip
    return run_optimize(model, work / "variants", None, eval_data, None, opts, sources)


def _goal(result: OptimizeResult, name: str) -> tuple[float, float, bool]:
    m = result.get(name)
    speed = ratio(result, name) if m else math.nan
    cos = m.metrics.get("cosine_mean", math.nan) if m else math.nan
    return speed, cos, speed >= GOAL_SPEEDUP and cos >= GOAL_COSINE


def section(settings: Settings) -> str:
    """The markdown of the structured-pruning section."""
    result = run(settings)
    name = SPEC.name
    pruned = result.get(name)
    notes = "; ".join(pruned.notes) if pruned else "not built"
    lines = [
        "## all-MiniLM-L6-v2: structured pruning of heads and FFN neurons (`structured-heads`)",
        "",
        f"`rtserve optimize ... --torch-model ... --train text.txt --prune "
        f"structured-heads:{SPEC.amount:g}:{SPEC.ffn_amount:g} --fine-tune-epochs "
        f"{SPEC.fine_tune_epochs}` cuts the weakest attention heads (norm of their contribution) "
        "and FFN neurons (mean |activation| x output-weight norm), trains the smaller model on the "
        "unpruned one's outputs (layer by layer, then end to end on embedding cosine plus hidden-"
        f"state MSE; at most {SPEC.fine_tune_seconds / 60:g} minutes here), exports it and also "
        f"quantizes it (INT8 dynamic). Pruned model: {notes}. Held out: the first {EVAL_SENTENCES} "
        f"sentences of `examples/data/sentences.txt`; distillation on {TRAIN_TEXTS} unlabelled texts "
        "(the other sentences, `pydoc_data` sentences, joins of both). Accuracy: cosine to FP32.",
        "",
    ]
    for label, variant in (("pruned", name), ("pruned + INT8 dynamic", f"{name}-int8")):
        speed, cos, met = _goal(result, variant)
        lines.append(
            f"- Goal for {label}: >= {GOAL_SPEEDUP}x at batch 1 with mean cosine >= "
            f"{GOAL_COSINE}: **{'met' if met else 'missed'}** ({speed:.2f}x, cosine {cos:.4f})."
        )
    chosen = result.chosen.name if result.chosen else None
    table = markdown_table(result.measurements, result.baseline, result.reference_score,
                           result.max_accuracy_drop, chosen)  # fmt: skip
    lines += ["", table]
    return "\n".join(lines)
