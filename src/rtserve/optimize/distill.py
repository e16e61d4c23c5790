"""Knowledge distillation: a student learns the teacher's softened logits.

The loss is ``alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, y)``;
the ``T^2`` factor keeps the soft-target gradients on the same scale as the hard ones
when the temperature changes. Without labels only the soft term is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rtserve.optimize.errors import OptimizeError

if TYPE_CHECKING:
    import torch


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float = 4.0,
    alpha: float = 0.7,
) -> torch.Tensor:
    """The distillation loss; ``alpha`` weighs the soft (teacher) term, in [0, 1]."""
    import torch.nn.functional as F

    if temperature <= 0:
        raise OptimizeError(f"distillation temperature must be > 0, got {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise OptimizeError(f"distillation alpha must be within [0, 1], got {alpha}")
    if student_logits.shape != teacher_logits.shape:
        raise OptimizeError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ in shape"
        )
    soft = F.kl_div(
        F.log_softmax(student_logits / temperature, dim=-1),
        F.log_softmax(teacher_logits / temperature, dim=-1),
        reduction="batchmean",
        log_target=True,
    ) * (temperature**2)
    if labels is None:
        return soft
    hard = F.cross_entropy(student_logits, labels)
    return alpha * soft + (1.0 - alpha) * hard


def _batches(n: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    order = rng.permutation(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def train_supervised(
    model: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    epochs: int = 30,
    lr: float = 1e-3,
    batch_size: int = 64,
    seed: int = 0,
) -> torch.nn.Module:
    """Plain cross-entropy training (Adam) of a classifier on float features."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(seed)
    xt, yt = torch.from_numpy(np.asarray(x, np.float32)), torch.from_numpy(np.asarray(y, np.int64))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for idx in _batches(len(xt), batch_size, rng):
            opt.zero_grad()
            loss = F.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
    return model.eval()


def distill(
    teacher: torch.nn.Module,
    student: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray | None = None,
    temperature: float = 4.0,
    alpha: float = 0.7,
    epochs: int = 60,
    lr: float = 3e-3,
    batch_size: int = 64,
    seed: int = 0,
) -> torch.nn.Module:
    """Train ``student`` on ``x`` against ``teacher``'s logits (and labels ``y`` when given)."""
    import torch

    if y is not None and len(y) != len(x):
        raise OptimizeError(f"distillation data has {len(x)} rows but {len(y)} labels")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    xt = torch.from_numpy(np.asarray(x, np.float32))
    yt = torch.from_numpy(np.asarray(y, np.int64)) if y is not None else None
    teacher.eval()
    with torch.no_grad():
        teacher_logits = teacher(xt)
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(epochs, 1))
    student.train()
    for _ in range(epochs):
        for idx in _batches(len(xt), batch_size, rng):
            opt.zero_grad()
            loss = kd_loss(
                student(xt[idx]),
                teacher_logits[idx],
                yt[idx] if yt is not None else None,
                temperature,
                alpha,
            )
            loss.backward()
            opt.step()
        sched.step()
    return student.eval()
