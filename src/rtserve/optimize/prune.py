"""Pruning a torch model before export: magnitude (unstructured) and structured.

- Magnitude pruning zeroes the smallest weights globally. Dense kernels do not skip
  zeros, so the ONNX file is as large and as fast as before; it is reported for accuracy.
- Structured pruning removes whole output neurons / channels by L2 norm. For a
  ``Sequential`` of ``Linear`` layers with element-wise activations between them the
  neurons are removed for real (smaller matrices, faster); elsewhere they are zeroed.
Either can be followed by fine-tuning: on labels with cross-entropy, or without labels
against the unpruned model's outputs.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Literal

import numpy as np

from rtserve.optimize.errors import OptimizeError

if TYPE_CHECKING:
    import torch

Method = Literal["magnitude", "structured"]


def _prunable(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    import torch

    layers: list[tuple[torch.nn.Module, str]] = [
        (m, "weight")
        for m in model.modules()
        if isinstance(m, torch.nn.Linear | torch.nn.Conv1d | torch.nn.Conv2d)
    ]
    if not layers:
        raise OptimizeError(f"{type(model).__name__} has no Linear or Conv layer to prune")
    return layers


def prune_magnitude(model: torch.nn.Module, amount: float) -> torch.nn.Module:
    """Zero the ``amount`` fraction of smallest-magnitude weights across all layers."""
    import torch.nn.utils.prune as tprune

    _check_amount(amount)
    layers = _prunable(model)
    tprune.global_unstructured(layers, pruning_method=tprune.L1Unstructured, amount=amount)
    for module, name in layers:
        tprune.remove(module, name)
    return model


def _check_amount(amount: float) -> None:
    if not 0.0 <= amount < 1.0:
        raise OptimizeError(f"pruning amount must be within [0, 1), got {amount}")


def _shrink_sequential(model: torch.nn.Sequential, amount: float) -> torch.nn.Sequential | None:
    """Remove the weakest output neurons of every hidden Linear of an MLP; None if not an MLP."""
    import torch

    layers = list(model)
    linear_idx = [i for i, m in enumerate(layers) if isinstance(m, torch.nn.Linear)]
    elementwise = (
        torch.nn.ReLU,
        torch.nn.ReLU6,
        torch.nn.GELU,
        torch.nn.Tanh,
        torch.nn.Sigmoid,
        torch.nn.Dropout,
        torch.nn.SiLU,
    )
    if len(linear_idx) < 2 or any(
        not isinstance(m, (torch.nn.Linear, *elementwise)) for m in layers
    ):
        return None
    new_layers = [copy.deepcopy(m) for m in layers]
    keep_prev: torch.Tensor | None = None
    for pos, i in enumerate(linear_idx):
        lin = new_layers[i]
        assert isinstance(lin, torch.nn.Linear)
        w = lin.weight.data
        b = lin.bias.data if lin.bias is not None else None
        if keep_prev is not None:
            w = w[:, keep_prev]
        if pos < len(linear_idx) - 1:
            n_keep = max(1, int(round(w.shape[0] * (1.0 - amount))))
            keep = torch.argsort(w.norm(dim=1), descending=True)[:n_keep].sort().values
            w = w[keep]
            b = b[keep] if b is not None else None
            keep_prev = keep
        new = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        new.weight.data.copy_(w)
        if b is not None and new.bias is not None:
            new.bias.data.copy_(b)
        new_layers[i] = new
    return torch.nn.Sequential(*new_layers)


def prune_structured(model: torch.nn.Module, amount: float) -> torch.nn.Module:
    """Remove (MLP) or zero (other models) the ``amount`` fraction of output neurons/channels."""
    import torch
    import torch.nn.utils.prune as tprune

    _check_amount(amount)
    if isinstance(model, torch.nn.Sequential):
        shrunk = _shrink_sequential(model, amount)
        if shrunk is not None:
            return shrunk
    layers = _prunable(model)
    for module, name in layers[:-1]:  # keep the output layer whole
        tprune.ln_structured(module, name, amount=amount, n=2, dim=0)
        tprune.remove(module, name)
    return model


def prune(model: torch.nn.Module, method: Method, amount: float) -> torch.nn.Module:
    """A pruned copy of ``model``."""
    model = copy.deepcopy(model)
    if method == "magnitude":
        return prune_magnitude(model, amount)
    if method == "structured":
        return prune_structured(model, amount)
    raise OptimizeError(f"unknown pruning method {method!r} (magnitude or structured)")


def fine_tune(
    model: torch.nn.Module,
    inputs: dict[str, np.ndarray],
    labels: np.ndarray | None = None,
    reference: torch.nn.Module | None = None,
    epochs: int = 10,
    lr: float = 1e-3,
    batch_size: int = 32,
    seed: int = 0,
) -> torch.nn.Module:
    """Fine-tune after pruning: cross-entropy on ``labels``, else MSE to ``reference`` outputs.

    Zeroed weights may grow back; magnitude pruning is therefore re-applied by the caller
    when sparsity matters.
    """
    import torch
    import torch.nn.functional as F

    if labels is None and reference is None:
        raise OptimizeError("fine-tuning needs labels or the unpruned reference model")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tensors = [torch.from_numpy(np.ascontiguousarray(v)) for v in inputs.values()]
    n = len(tensors[0])
    targets: torch.Tensor
    if labels is not None:
        targets = torch.from_numpy(np.asarray(labels, np.int64))
    else:
        assert reference is not None
        with torch.no_grad():
            targets = reference.eval()(*tensors)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        order = rng.permutation(n)
        for i in range(0, n, batch_size):
            idx = torch.from_numpy(order[i : i + batch_size])
            opt.zero_grad()
            out = model(*(t[idx] for t in tensors))
            loss = (
                F.cross_entropy(out, targets[idx])
                if labels is not None
                else F.mse_loss(out, targets[idx])
            )
            loss.backward()
            opt.step()
    return model.eval()
