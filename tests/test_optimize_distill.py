"""Knowledge distillation: the loss and a student that learns from its teacher."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rtserve.optimize.distill import distill, kd_loss, train_supervised
from rtserve.optimize.errors import OptimizeError


def test_kd_loss_is_kl_scaled_by_t_squared() -> None:
    torch.manual_seed(0)
    s, t = torch.randn(8, 5), torch.randn(8, 5)
    temp = 3.0
    expected = F.kl_div(F.log_softmax(s / temp, -1), F.softmax(t / temp, -1), reduction="batchmean")
    got = kd_loss(s, t, None, temperature=temp)
    torch.testing.assert_close(got, expected * temp**2)


def test_kd_loss_mixes_soft_and_hard_terms_by_alpha() -> None:
    torch.manual_seed(1)
    s, t = torch.randn(8, 5), torch.randn(8, 5)
    y = torch.randint(0, 5, (8,))
    soft = kd_loss(s, t, None, temperature=2.0)
    hard = F.cross_entropy(s, y)
    torch.testing.assert_close(kd_loss(s, t, y, 2.0, alpha=0.0), hard)
    torch.testing.assert_close(kd_loss(s, t, y, 2.0, alpha=1.0), soft)
    torch.testing.assert_close(kd_loss(s, t, y, 2.0, alpha=0.25), 0.25 * soft + 0.75 * hard)


def test_kd_loss_is_zero_when_student_matches_teacher() -> None:
    t = torch.randn(4, 3)
    assert kd_loss(t.clone(), t, None, 4.0).abs().item() < 1e-6


def test_kd_loss_rejects_bad_parameters() -> None:
    s = torch.zeros(2, 3)
    with pytest.raises(OptimizeError, match="temperature"):
        kd_loss(s, s, None, temperature=0.0)
    with pytest.raises(OptimizeError, match="alpha"):
        kd_loss(s, s, None, alpha=1.5)
    with pytest.raises(OptimizeError, match="differ in shape"):
        kd_loss(s, torch.zeros(2, 4), None)


def test_distilled_student_learns_the_teacher() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + 2 * (x[:, 2] > 0).astype(np.int64)
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    train_supervised(teacher, x, y, epochs=30, lr=3e-3)
    student = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    xt = torch.from_numpy(x)
    with torch.no_grad():
        before = (student(xt).argmax(1) == teacher(xt).argmax(1)).float().mean().item()
    distill(teacher, student, x, y, temperature=4.0, alpha=0.7, epochs=60, lr=1e-2)
    with torch.no_grad():
        after = (student(xt).argmax(1) == teacher(xt).argmax(1)).float().mean().item()
    assert after > max(before, 0.85)
