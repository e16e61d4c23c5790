"""Structured pruning of a transformer encoder: heads and FFN neurons cut, distilled, exported."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.export import export_module
from rtserve.optimize.pipeline import OptimizeOptions, TorchSources, parse_prune_spec, run_optimize
from rtserve.optimize.prune_transformer import (
    distill_encoder,
    encoder_layers,
    head_importance,
    head_norms,
    prune_encoder,
    reconstruct_layers,
)

HEADS, LAYERS, HIDDEN, FFN, VOCAB, SEQ = 4, 2, 32, 64, 100, 12


class Embedder(torch.nn.Module):
    """A tiny random BERT with mean pooling, shaped like the MiniLM sentence embedder.

    Weights are drawn wide (std 0.2) so that every head and neuron matters: with BERT's
    default 0.02 the residual stream dominates and pruning barely changes the output.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(seed)
        config = BertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=SEQ,
            initializer_range=0.2, attn_implementation="eager",
        )  # fmt: skip
        self.inner = BertModel(config).eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.inner(input_ids=input_ids, attention_mask=attention_mask)[0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def tokens(rows: int, seed: int) -> dict[str, np.ndarray]:
    """Random token ids with random real lengths (padding after them)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(rows, SEQ)).astype(np.int64)
    lengths = rng.integers(3, SEQ + 1, size=rows)
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int64)
    return {"input_ids": ids * mask, "attention_mask": mask}


def _run(model: torch.nn.Module, data: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return model(*(torch.from_numpy(v) for v in data.values())).numpy()


def test_pruning_cuts_heads_and_neurons_out_of_the_matrices() -> None:
    model = Embedder()
    pruned, summary = prune_encoder(model, tokens(16, 1), heads=0.5, ffn=0.75)
    layers = encoder_layers(pruned)
    assert sum(la.heads for la in layers) == LAYERS * HEADS // 2
    assert all(la.heads >= 1 for la in layers)
    for la in layers:
        width = la.heads * la.head_size
        assert (
            la.query.weight.shape == la.key.weight.shape == la.value.weight.shape == (width, HIDDEN)
        )
        assert la.attn_out.weight.shape == (HIDDEN, width)
        assert la.ffn_in.weight.shape == (FFN // 4, HIDDEN)
        assert la.ffn_out.weight.shape == (HIDDEN, FFN // 4)
    assert summary.params_after < summary.params_before
    assert [la.heads for la in encoder_layers(model)] == [HEADS] * LAYERS  # the original is kept
    assert _run(pruned, tokens(3, 2)).shape == (3, HIDDEN)


def test_pruned_model_equals_the_original_with_those_heads_and_neurons_zeroed() -> None:
    """Cutting a head out is exactly zeroing its value rows; a neuron, its input row."""
    model = Embedder()
    pruned, _ = prune_encoder(model, tokens(16, 1), heads=0.5, ffn=0.5, refit=False)
    masked = Embedder()
    for full, cut in zip(encoder_layers(masked), encoder_layers(pruned), strict=True):
        kept_rows = {tuple(r.tolist()) for r in cut.value.weight.data}
        for h in range(full.heads):
            rows = slice(h * full.head_size, (h + 1) * full.head_size)
            if tuple(full.value.weight.data[rows][0].tolist()) not in kept_rows:
                full.value.weight.data[rows] = 0
                full.value.bias.data[rows] = 0
        kept = {tuple(r.tolist()) for r in cut.ffn_in.weight.data}
        for j in range(full.neurons):
            if tuple(full.ffn_in.weight.data[j].tolist()) not in kept:
                full.ffn_in.weight.data[j] = 0
                full.ffn_in.bias.data[j] = 0
    data = tokens(8, 3)
    np.testing.assert_allclose(_run(pruned, data), _run(masked, data), atol=1e-5)


def _error(model: torch.nn.Module, teacher: torch.nn.Module, data: dict[str, np.ndarray]) -> float:
    a, b = _run(model, data), _run(teacher, data)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_least_squares_refit_brings_the_pruned_model_closer_to_the_teacher() -> None:
    teacher, sample, held_out = Embedder(), tokens(64, 1), tokens(32, 99)
    plain, _ = prune_encoder(teacher, sample, heads=0.5, ffn=0.5, refit=False)
    refitted, summary = prune_encoder(teacher, sample, heads=0.5, ffn=0.5)
    assert "refitted" in " ".join(summary.notes)
    assert _error(refitted, teacher, held_out) < 0.9 * _error(plain, teacher, held_out)
    layers = encoder_layers(refitted)
    assert [la.ffn_out.weight.shape for la in layers] == [(HIDDEN, FFN // 2)] * LAYERS


def test_both_head_importances_rank_the_same_shape() -> None:
    model, data = Embedder(), tokens(8, 1)
    norms, ablation = head_norms(model, data), head_importance(model, data)
    assert norms.shape == ablation.shape == (LAYERS, HEADS)
    assert (norms > 0).all() and (ablation > 0).all()


def test_exported_pruned_model_runs_in_onnx_runtime_like_torch(tmp_path: pathlib.Path) -> None:
    pruned, _ = prune_encoder(Embedder(), tokens(16, 1), heads=0.5, ffn=0.5)
    path = export_module(pruned, tmp_path / "pruned.onnx", tokens(2, 0), ["embedding"])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    matmul_widths = {
        tuple(init.dims)
        for init in __import__("onnx").load(str(path)).graph.initializer
        if len(init.dims) == 2
    }
    assert (HIDDEN, FFN // 2) in matmul_widths and (HIDDEN, FFN) not in matmul_widths
    for rows in (1, 5):
        data = tokens(rows, 10 + rows)
        (got,) = session.run(None, data)
        np.testing.assert_allclose(got, _run(pruned, data), atol=1e-4)


def _half_cut() -> tuple[Embedder, torch.nn.Module]:
    """A teacher and its copy with half the heads and half the FFN neurons cut, untrained."""
    teacher = Embedder()
    pruned, _ = prune_encoder(teacher, tokens(16, 1), heads=0.5, ffn=0.5, refit=False)
    return teacher, pruned


def _recovered(recover: Callable[..., Any]) -> tuple[float, float, Any]:
    """Relative error to the teacher of the half cut before and after ``recover`` trains it."""
    teacher, pruned = _half_cut()
    held_out = tokens(32, 99)
    before = _error(pruned, teacher, held_out)
    student, run = recover(pruned, teacher, tokens(128, 5), epochs=4, lr=1e-3)
    assert not student.training
    return before, _error(student, teacher, held_out), run


def test_distillation_brings_the_pruned_model_closer_to_the_teacher() -> None:
    before, after, fit = _recovered(distill_encoder)
    assert after < 0.8 * before
    assert (fit.steps, fit.planned, fit.epochs) == (16, 16, 4.0)
    assert fit.seconds > 0


def test_distillation_stops_at_its_time_budget() -> None:
    teacher, pruned = _half_cut()
    _, fit = distill_encoder(pruned, teacher, tokens(128, 5), epochs=50, max_seconds=0.0)
    assert fit.steps == 0 and fit.planned == 200


def test_layerwise_reconstruction_brings_the_pruned_model_closer_to_the_teacher() -> None:
    before, after, run = _recovered(reconstruct_layers)
    assert after < 0.8 * before
    assert run.steps == [16] * LAYERS and len(run.errors) == LAYERS
    assert all(0.0 <= e < 1.0 for e in run.errors) and run.seconds > 0


def test_layerwise_reconstruction_stops_at_its_time_budget() -> None:
    teacher, pruned = _half_cut()
    _, run = reconstruct_layers(pruned, teacher, tokens(128, 5), epochs=50, max_seconds=0.0)
    assert run.steps == [0] * LAYERS


def test_encoder_layers_of_a_model_without_them_is_a_clear_error() -> None:
    with pytest.raises(OptimizeError, match="no BERT-style encoder layer"):
        prune_encoder(torch.nn.Sequential(torch.nn.Linear(4, 4)), {"x": np.zeros((2, 4))}, 0.5, 0.5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("heads:0.5", "unknown method 'heads'"),
        ("structured-heads", "expected magnitude:AMOUNT"),
        ("structured-heads:0.5:0.5:0.5", "structured-heads:HEADS\\[:FFN\\]"),
        ("structured-heads:half", "amounts must be numbers"),
        ("structured-heads:1.0", "within \\[0, 1\\)"),
        ("structured-heads:0.5:-0.1", "within \\[0, 1\\)"),
        ("structured-heads:0:0", "prunes nothing"),
        ("magnitude:0.3:0.2", "expected magnitude:AMOUNT"),
    ],
)
def test_prune_spec_parser_rejects_bad_specs(text: str, message: str) -> None:
    with pytest.raises(OptimizeError, match=message) as err:
        parse_prune_spec(text)
    assert f"--prune {text!r}" in err.value.message


def test_prune_spec_parser_reads_heads_and_ffn() -> None:
    spec = parse_prune_spec("structured-heads:0.5:0.25", fine_tune_epochs=2)
    assert (spec.amount, spec.ffn_amount, spec.fine_tune_epochs) == (0.5, 0.25, 2)
    assert spec.name == "pruned-heads-50-ffn-25"
    assert parse_prune_spec("structured-heads:0.4").name == "pruned-heads-40-ffn-40"
    assert parse_prune_spec("magnitude:0.3").name == "pruned-magnitude-30"


def test_optimize_builds_and_measures_the_pruned_encoder_and_its_int8(
    tmp_path: pathlib.Path,
) -> None:
    teacher = Embedder()
    baseline = export_module(teacher, tmp_path / "model.onnx", tokens(2, 0), ["embedding"])
    sources = TorchSources(
        model=teacher,
        train_inputs=tokens(64, 4),
        prune=[parse_prune_spec("structured-heads:0.5", 1)],
    )
    options = OptimizeOptions(
        variants=("pruned",), task="embedding", iterations=5, max_seconds=0.2, rounds=1,
        batch_sizes=(1,), progress=False,
    )  # fmt: skip
    result = run_optimize(baseline, tmp_path / "work", None, tokens(16, 7), None, options, sources)
    names = {m.name for m in result.measurements}
    assert {"pruned-heads-50-ffn-50", "pruned-heads-50-ffn-50-int8"} <= names
    pruned = result.get("pruned-heads-50-ffn-50")
    assert pruned is not None and pruned.size_bytes < result.measurements[0].size_bytes
    assert "heads 8 -> 4" in " ".join(pruned.notes)
    assert 0.0 < pruned.metrics["cosine_mean"] <= 1.0 + 1e-6


def test_a_model_with_different_heads_per_layer_prunes_again() -> None:
    from rtserve.optimize.prune_transformer import keep_heads

    model = Embedder()
    data = tokens(16, 1)
    keep_heads(encoder_layers(model)[0], [0, 1])  # layer 0: 2 heads, layer 1: 4
    assert [la.heads for la in encoder_layers(model)] == [2, HEADS]
    pruned, _ = prune_encoder(model, data, heads=0.5, ffn=0.25)  # (head norms of 2 and 4)
    assert sum(la.heads for la in encoder_layers(pruned)) == (2 + HEADS) // 2
    assert _run(pruned, data).shape == (16, HIDDEN)


def test_shared_layers_and_other_architectures_are_refused_by_name() -> None:
    from transformers import DistilBertConfig, DistilBertModel

    shared = Embedder()
    shared.inner.encoder.layer[1] = shared.inner.encoder.layer[0]  # ALBERT-style sharing
    with pytest.raises(OptimizeError, match="used at several depths"):
        prune_encoder(shared, tokens(8, 1), heads=0.5, ffn=0.5)
    distil = DistilBertModel(
        DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=1, n_heads=HEADS, hidden_dim=FFN)
    )
    with pytest.raises(OptimizeError, match=r"DistilBertModel .*no BERT-style encoder layer"):
        encoder_layers(distil)
