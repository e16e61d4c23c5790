"""Tiny torch and ONNX models shared by the optimization tests (built in seconds)."""

from __future__ import annotations

import pathlib

import numpy as np
import torch

from rtserve.optimize.export import export_module


def tiny_mlp(
    seed: int = 0, features: int = 16, hidden: int = 32, classes: int = 4
) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes),
    ).eval()


class TinyCNN(torch.nn.Module):
    """Conv (3x3), depthwise conv, ReLU6, pooling and a classifier: a miniature mobile CNN."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pw = torch.nn.Conv2d(8, 16, 1)
        self.act = torch.nn.ReLU6()
        self.fc = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.stem(x))
        x = self.act(self.dw(x))
        x = self.act(self.pw(x))
        return self.fc(x.mean(dim=(2, 3)))


def mlp_onnx(
    path: pathlib.Path, model: torch.nn.Module | None = None, features: int = 16
) -> pathlib.Path:
    model = model if model is not None else tiny_mlp(features=features)
    return export_module(
        model, path, {"x": np.zeros((2, features), np.float32)}, output_names=["logits"]
    )


def cnn_onnx(path: pathlib.Path) -> pathlib.Path:
    return export_module(
        TinyCNN().eval(), path, {"image": np.zeros((2, 3, 16, 16), np.float32)}, ["logits"]
    )


def features(rows: int, n: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, n)).astype(np.float32)


def images(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (rows, 3, 16, 16)).astype(np.float32)


def test_helpers_build_runnable_models(tmp_path: pathlib.Path) -> None:
    import onnxruntime as ort

    for path, feed in (
        (mlp_onnx(tmp_path / "mlp.onnx"), {"x": features(3)}),
        (cnn_onnx(tmp_path / "cnn.onnx"), {"image": images(3)}),
    ):
        out = ort.InferenceSession(str(path)).run(None, feed)[0]
        assert out.shape[0] == 3
