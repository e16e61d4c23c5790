"""Where MiniLM's batch-1 time goes: heads against FFN neurons, cut without training.

    python -m bench.prune_tradeoff [--rounds 7]    # run it under the benchmark lock

For each (heads, FFN) fraction, ``prune_encoder`` (norm importance, least-squares refit,
no distillation) cuts all-MiniLM-L6-v2; the table gives the mean cosine to the unpruned
embeddings on the showcase's held-out sentences and the batch-1 latency of each export
in ONNX Runtime (2 threads, one 32-token row), timed in alternating rounds.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time
from collections.abc import Mapping

import numpy as np

from bench.showcase import zoo
from bench.showcase.report import SENTENCES
from bench.showcase.structured_prune import EVAL_SENTENCES, training_texts
from rtserve.optimize.data import read_sentences

CUTS = ((0.0, 0.0), (0.5, 0.0), (0.0, 0.5), (0.0, 0.75), (0.5, 0.5), (0.75, 0.25), (0.25, 0.75))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)))


def build(work: pathlib.Path) -> dict[tuple[float, float], tuple[pathlib.Path, float]]:
    """Export every cut; returns its path and its mean cosine to the unpruned model."""
    import torch

    from rtserve.optimize.export import export_module
    from rtserve.optimize.prune_transformer import prune_encoder

    torch.set_num_threads(2)
    sentences = read_sentences(SENTENCES)
    held = zoo.minilm_tokenize(sentences[:EVAL_SENTENCES], 32)
    sample = zoo.minilm_tokenize(training_texts(sentences[EVAL_SENTENCES:], 128), 32)
    teacher = zoo.minilm_module()
    x = [torch.from_numpy(v) for v in held.values()]
    with torch.no_grad():
        reference = teacher(*x).numpy()
    built = {}
    for heads, ffn in CUTS:
        model = teacher
        if heads or ffn:
            model, _ = prune_encoder(teacher, sample, heads, ffn, refit=True)
        with torch.no_grad():
            cosine = _cosine(model(*x).numpy(), reference)
        example = {k: v[:2] for k, v in held.items()}
        path = export_module(model, work / f"cut-{heads}-{ffn}.onnx", example, ["embedding"])
        built[(heads, ffn)] = (path, cosine)
    return built


def time_b1(paths: Mapping[tuple[float, float], pathlib.Path], rounds: int) -> dict:
    """Median over alternating rounds of each model's batch-1 p50, in ms."""
    import onnxruntime as ort

    row = zoo.minilm_tokenize(read_sentences(SENTENCES)[:1], 32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    sessions = {
        k: ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"])
        for k, p in paths.items()
    }
    p50s: dict[tuple[float, float], list[float]] = {k: [] for k in sessions}
    for _ in range(rounds):
        for key, session in sessions.items():
            for _ in range(5):
                session.run(None, row)
            times = []
            for _ in range(50):
                start = time.perf_counter()
                session.run(None, row)
                times.append(time.perf_counter() - start)
            p50s[key].append(float(np.median(times)) * 1e3)
    return {k: float(np.median(v)) for k, v in p50s.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        built = build(pathlib.Path(tmp))
        ms = time_b1({k: p for k, (p, _) in built.items()}, args.rounds)
    base = ms[(0.0, 0.0)]
    print("| heads cut | FFN cut | p50 b1 | speed-up b1 | mean cosine (untrained) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for (heads, ffn), (_, cosine) in built.items():
        t = ms[(heads, ffn)]
        print(f"| {heads:.0%} | {ffn:.0%} | {t:.2f} ms | {base / t:.2f}x | {cosine:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
