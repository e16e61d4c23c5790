"""How far layer-wise reconstruction brings structured-pruned MiniLM back, per cut.

    python -m bench.prune_recovery [--epochs 3] [--cuts 0.5:0.5,0:0.5,0.5:0,0.75:0.25]

For each (heads, FFN) cut, ``prune_encoder`` (norm importance, no refit) cuts
all-MiniLM-L6-v2, then ``reconstruct_layers`` trains it layer by layer on the showcase's
3000 distillation texts; the table gives the mean (min) cosine to the unpruned embeddings
on the showcase's held-out sentences before and after, and the training seconds. Batch-1
speed per cut: ``python -m bench.prune_tradeoff``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.showcase import zoo
from bench.showcase.report import SENTENCES
from bench.showcase.structured_prune import EVAL_SENTENCES, TRAIN_TEXTS, training_texts
from rtserve.optimize.data import read_sentences


def _cosine(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    c = np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(c.mean()), float(c.min())


def main() -> int:
    import torch

    from rtserve.optimize.prune_transformer import prune_encoder, reconstruct_layers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cuts", default="0.5:0.5,0:0.5,0.5:0,0.75:0.25")
    args = parser.parse_args()
    torch.set_num_threads(2)
    sentences = read_sentences(SENTENCES)
    held = zoo.minilm_tokenize(sentences[:EVAL_SENTENCES], 32)
    train = zoo.minilm_tokenize(training_texts(sentences[EVAL_SENTENCES:], TRAIN_TEXTS), 32)
    teacher = zoo.minilm_module()

    def embed(model: torch.nn.Module) -> np.ndarray:
        with torch.no_grad():
            return model(*(torch.from_numpy(v) for v in held.values())).numpy()

    reference = embed(teacher)
    print("| heads cut | FFN cut | cosine cut | cosine layer-wise | seconds |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for cut in args.cuts.split(","):
        heads, ffn = (float(v) for v in cut.split(":"))
        sample = {k: v[:128] for k, v in train.items()}
        model, _ = prune_encoder(teacher, sample, heads, ffn, refit=False)
        before = _cosine(embed(model), reference)
        start = time.perf_counter()
        model, _ = reconstruct_layers(model, teacher, train, epochs=args.epochs)
        seconds = time.perf_counter() - start
        after = _cosine(embed(model), reference)
        print(
            f"| {heads:.0%} | {ffn:.0%} | {before[0]:.3f} ({before[1]:.2f}) | "
            f"{after[0]:.3f} ({after[1]:.2f}) | {seconds:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
