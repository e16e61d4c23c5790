"""Pruning: magnitude sparsity, structured shrinking, fine-tuning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.prune import fine_tune, prune
from tests.test_optimize_helpers import TinyCNN, tiny_mlp


def _sparsity(model: torch.nn.Module) -> float:
    ws = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)]
    return float(sum((w == 0).sum() for w in ws) / sum(w.numel() for w in ws))


def test_magnitude_pruning_reaches_the_requested_sparsity_and_leaves_the_original() -> None:
    model = tiny_mlp()
    pruned = prune(model, "magnitude", 0.4)
    assert abs(_sparsity(pruned) - 0.4) < 0.01
    assert _sparsity(model) < 0.01


def test_structured_pruning_shrinks_an_mlp_and_keeps_its_interface() -> None:
    model = tiny_mlp(hidden=32)
    pruned = prune(model, "structured", 0.5)
    linears = [m for m in pruned.modules() if isinstance(m, torch.nn.Linear)]
    assert [lin.out_features for lin in linears] == [16, 16, 4]
    assert linears[0].in_features == 16
    out = pruned(torch.zeros(3, 16))
    assert out.shape == (3, 4)


def test_structured_pruning_zeroes_channels_of_other_models() -> None:
    pruned = prune(TinyCNN(), "structured", 0.5)
    stem = pruned.stem.weight.detach().flatten(1)
    assert int((stem.abs().sum(1) == 0).sum()) == 4


def test_fine_tuning_recovers_accuracy_on_labels() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 16)).astype(np.float32)
    y = x[:, :4].argmax(1).astype(np.int64)
    model = prune(tiny_mlp(hidden=32), "structured", 0.5)
    xt = torch.from_numpy(x)

    def acc() -> float:
        with torch.no_grad():
            return float((model(xt).argmax(1).numpy() == y).mean())

    before = acc()
    fine_tune(model, {"x": x}, y, epochs=20, lr=5e-3)
    assert acc() > max(before, 0.7)


def test_bad_pruning_requests_are_rejected() -> None:
    with pytest.raises(OptimizeError, match="within"):
        prune(tiny_mlp(), "magnitude", 1.0)
    with pytest.raises(OptimizeError, match="unknown pruning method"):
        prune(tiny_mlp(), "random", 0.1)  # type: ignore[arg-type]
