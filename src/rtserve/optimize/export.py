"""PyTorch -> ONNX with dynamic batch (and sequence) axes, verified against torch.

A model is given as an import path (``package.module:attr`` where ``attr`` is an
``nn.Module`` or a callable returning one), a TorchScript file (``.pt`` / ``.ts``) or an
ExportedProgram file (``.pt2``). After export, torch and ONNX Runtime run the same random
and given inputs and the largest absolute difference per output is reported.
"""

from __future__ import annotations

import importlib
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rtserve.optimize.errors import OptimizeError

if TYPE_CHECKING:
    import torch


@dataclass
class Verification:
    """Largest absolute difference between torch and ONNX Runtime, per output name."""

    max_abs_diff: dict[str, float] = field(default_factory=dict)
    batches: int = 0

    @property
    def worst(self) -> float:
        return max(self.max_abs_diff.values(), default=0.0)

    def ok(self, tolerance: float) -> bool:
        return self.worst <= tolerance


def load_module(spec: str) -> torch.nn.Module:
    """Load a torch model from an import path or a TorchScript / ExportedProgram file."""
    import torch

    path = pathlib.Path(spec)
    if path.suffix in {".pt", ".pth", ".ts", ".pt2", ".jit"} or path.exists():
        if not path.is_file():
            raise OptimizeError(
                f"model file {spec} "
                + ("is a folder, not a file" if path.is_dir() else "does not exist")
            )
        if path.suffix == ".pt2":
            try:
                program = torch.export.load(str(path))
            except Exception as exc:
                raise OptimizeError(f"{spec} is not a torch.export ExportedProgram: {exc}") from exc
            return _unpacked(program.module())
        try:
            return torch.jit.load(str(path), map_location="cpu").eval()
        except Exception as exc:
            raise OptimizeError(f"{spec} is not a TorchScript file: {exc}") from exc
    if ":" not in spec:
        raise OptimizeError(
            f"model {spec!r} is neither a file nor an import path of the form 'package.module:name'"
        )
    module_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(module_name)
    except ImportError as exc:
        raise OptimizeError(f"cannot import {module_name!r} (from {spec!r}): {exc}") from exc
    try:
        obj = getattr(mod, attr)
    except AttributeError as exc:
        raise OptimizeError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if not isinstance(obj, torch.nn.Module) and callable(obj):
        try:
            obj = obj()
        except Exception as exc:
            raise OptimizeError(
                f"{spec!r}: calling it raised {type(exc).__name__}: {exc}"
            ) from None
    if not isinstance(obj, torch.nn.Module):
        raise OptimizeError(f"{spec!r} is not a torch.nn.Module nor a function returning one")
    return obj.eval()


def _unpacked_class() -> type:
    import torch

    class Unpacked(torch.nn.Module):
        """An ExportedProgram's module: always in inference mode (it refuses train/eval)."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def train(self, mode: bool = True) -> Unpacked:
            return self

        def forward(self, *args: Any) -> Any:
            return self.inner(*args)

    return Unpacked


def _unpacked(inner: Any) -> torch.nn.Module:
    module: torch.nn.Module = _unpacked_class()(inner)
    return module


def _eval_mode(model: torch.nn.Module) -> torch.nn.Module:
    """``model.eval()``; modules unpacked from an ExportedProgram refuse it and need none."""
    try:
        return model.eval()
    except NotImplementedError:
        return model


def default_dynamic_axes(
    example_inputs: Mapping[str, np.ndarray], output_names: Sequence[str], sequence: bool = True
) -> dict[str, dict[int, str]]:
    """Axis 0 of every input and output is ``batch``; axis 1 of 2-D integer inputs is ``sequence``."""
    axes: dict[str, dict[int, str]] = {}
    for name, array in example_inputs.items():
        axes[name] = {0: "batch"}
        if sequence and array.ndim == 2 and np.issubdtype(array.dtype, np.integer):
            axes[name][1] = "sequence"
    for name in output_names:
        axes[name] = {0: "batch"}
    return axes


def export_module(
    model: torch.nn.Module,
    path: pathlib.Path,
    example_inputs: Mapping[str, np.ndarray],
    output_names: Sequence[str] = ("output",),
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    opset: int = 17,
) -> pathlib.Path:
    """Export ``model`` to ``path``; the example batch should have at least 2 rows."""
    import torch

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(example_inputs)
    args = tuple(torch.from_numpy(np.ascontiguousarray(example_inputs[n])) for n in names)
    axes = (
        dynamic_axes
        if dynamic_axes is not None
        else default_dynamic_axes(example_inputs, output_names)
    )
    model = _eval_mode(model)
    try:
        with torch.no_grad():
            torch.onnx.export(
                model,
                args,
                str(path),
                input_names=names,
                output_names=list(output_names),
                dynamic_axes={k: dict(v) for k, v in axes.items()},
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
    except Exception as exc:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OptimizeError(f"export of {type(model).__name__} to ONNX failed: {what}") from exc
    return path


def random_inputs(
    example_inputs: Mapping[str, np.ndarray], batch: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs like the examples with ``batch`` rows: ints within the example's range."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, ex in example_inputs.items():
        shape = (batch, *ex.shape[1:])
        if np.issubdtype(ex.dtype, np.integer):
            low, high = int(ex.min()), int(ex.max())
            if name.endswith("mask"):
                out[name] = np.ones(shape, dtype=ex.dtype)
            else:
                out[name] = rng.integers(low, max(high, low) + 1, size=shape).astype(ex.dtype)
        elif ex.dtype == np.bool_:
            out[name] = rng.random(shape) > 0.5
        else:
            out[name] = rng.standard_normal(shape).astype(ex.dtype)
    return out


def verify_export(
    model: torch.nn.Module,
    onnx_path: pathlib.Path,
    batches: Sequence[Mapping[str, np.ndarray]],
) -> Verification:
    """Run torch and ONNX Runtime on each batch; record the max abs difference per output."""
    import onnxruntime as ort
    import torch

    from rtserve.optimize.evaluate import open_session

    session = open_session(onnx_path, graph_optimization=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    output_names = [o.name for o in session.get_outputs()]
    result = Verification()
    for batch in batches:
        feed = {k: np.ascontiguousarray(v) for k, v in batch.items()}
        shapes = {k: v.shape for k, v in feed.items()}
        try:
            with torch.no_grad():
                expected = model(*(torch.from_numpy(v) for v in feed.values()))
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise OptimizeError(
                f"the torch model failed on inputs of shapes {shapes}: {first} (an "
                "ExportedProgram needs a dynamic batch dimension, torch.export.Dim)"
            ) from exc
        if isinstance(expected, torch.Tensor):
            expected_list = [expected]
        elif isinstance(expected, Mapping):
            expected_list = list(expected.values())
        else:
            expected_list = list(expected)
        got = session.run(None, feed)
        for name, e, g in zip(output_names, expected_list, got, strict=False):
            diff = (
                float(np.max(np.abs(e.detach().numpy().astype(np.float64) - g))) if g.size else 0.0
            )
            result.max_abs_diff[name] = max(result.max_abs_diff.get(name, 0.0), diff)
        result.batches += 1
    return result


def export_and_verify(
    model: torch.nn.Module,
    path: pathlib.Path,
    example_inputs: Mapping[str, np.ndarray],
    output_names: Sequence[str] = ("output",),
    given: Sequence[Mapping[str, np.ndarray]] = (),
    random_batches: Sequence[int] = (1, 3),
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
) -> Verification:
    """Export, then verify on random batches of the given sizes and on the given inputs."""
    export_module(model, path, example_inputs, output_names, dynamic_axes)
    batches: list[Mapping[str, np.ndarray]] = [
        random_inputs(example_inputs, b, seed=i) for i, b in enumerate(random_batches)
    ]
    batches.extend(given)
    return verify_export(model, path, batches)
