"""Export to ONNX: dynamic axes and verification against torch."""

from __future__ import annotations

import pathlib

import numpy as np
import onnxruntime as ort
import pytest
import torch

from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.export import export_and_verify, load_module
from tests.test_optimize_helpers import TinyCNN, features, tiny_mlp


def test_export_verifies_against_torch_on_random_and_given_inputs(tmp_path: pathlib.Path) -> None:
    model = tiny_mlp()
    given = [{"x": features(7, seed=3)}]
    result = export_and_verify(
        model, tmp_path / "m.onnx", {"x": np.zeros((2, 16), np.float32)}, ["logits"], given=given
    )
    assert result.batches == 3  # batch 1, batch 3, the given batch
    assert set(result.max_abs_diff) == {"logits"}
    assert result.ok(1e-4)


def test_export_has_dynamic_batch_and_sequence_axes(tmp_path: pathlib.Path) -> None:
    class Embed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids).mean(dim=1)

    example = {"ids": np.ones((2, 5), np.int64)}
    result = export_and_verify(Embed(), tmp_path / "e.onnx", example, ["pooled"])
    assert result.ok(1e-5)
    session = ort.InferenceSession(str(tmp_path / "e.onnx"))
    assert session.get_inputs()[0].shape == ["batch", "sequence"]
    out = session.run(None, {"ids": np.ones((4, 9), np.int64)})[0]
    assert out.shape == (4, 8)


def test_export_from_torchscript_file(tmp_path: pathlib.Path) -> None:
    scripted = torch.jit.trace(TinyCNN().eval(), torch.zeros(2, 3, 16, 16))
    path = tmp_path / "cnn.pt"
    scripted.save(str(path))
    model = load_module(str(path))
    result = export_and_verify(
        model, tmp_path / "cnn.onnx", {"image": np.zeros((2, 3, 16, 16), np.float32)}, ["logits"]
    )
    assert result.ok(1e-4)


def test_load_module_from_import_path() -> None:
    model = load_module("tests.test_optimize_helpers:tiny_mlp")
    assert isinstance(model, torch.nn.Sequential)


def test_load_module_errors_name_the_problem(tmp_path: pathlib.Path) -> None:
    with pytest.raises(OptimizeError, match="does not exist"):
        load_module(str(tmp_path / "missing.pt"))
    with pytest.raises(OptimizeError, match="no attribute 'nope'"):
        load_module("tests.test_optimize_helpers:nope")
    with pytest.raises(OptimizeError, match="neither a file nor an import path"):
        load_module("just-a-word")


def test_export_of_an_unsupported_torch_operator_names_it(tmp_path: pathlib.Path) -> None:
    class UsesSvd(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.svd(x)[1]

    with pytest.raises(OptimizeError, match="UsesSvd.*aten::linalg_svd"):
        export_and_verify(UsesSvd(), tmp_path / "u.onnx", {"x": np.ones((3, 3), np.float32)})


def test_export_from_exported_program_file(tmp_path: pathlib.Path) -> None:
    batch = torch.export.Dim("batch")
    program = torch.export.export(
        tiny_mlp(), (torch.zeros(2, 16),), dynamic_shapes={"input": {0: batch}}
    )
    path = tmp_path / "mlp.pt2"
    torch.export.save(program, str(path))
    model = load_module(str(path))
    result = export_and_verify(
        model, tmp_path / "mlp.onnx", {"x": np.zeros((2, 16), np.float32)}, ["logits"]
    )
    assert result.ok(1e-4)


def test_exported_program_with_static_batch_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    program = torch.export.export(tiny_mlp(), (torch.zeros(2, 16),))
    path = tmp_path / "static.pt2"
    torch.export.save(program, str(path))
    with pytest.raises(OptimizeError, match="failed on inputs of shapes.*torch.export.Dim"):
        export_and_verify(
            load_module(str(path)), tmp_path / "s.onnx", {"x": np.zeros((2, 16), np.float32)}
        )
