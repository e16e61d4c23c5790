"""PyTorch -> LiteRT (``.tflite``) with ``litert-torch``, FP32 or fully INT8 (PT2E static).

``litert-torch`` pins ``typing-extensions<4.13`` (through ``xdsl``), which can clash with
the packages beside rtserve, so ``rtserve export-edge`` may run this module in another
interpreter that has it (``--converter-python``)::

    python -m rtserve.optimize.litert_convert MODEL --example ex.npz --out m.tflite \
        [--int8-out m-int8.tflite --calibration calib.npz] [--output-name NAME ...]

It needs only torch, numpy and litert-torch there; rtserve's package directory is put on
``PYTHONPATH`` by the caller.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.export import load_module

if TYPE_CHECKING:
    import torch


def _named(model: torch.nn.Module, inputs: Sequence[str], outputs: Sequence[str]) -> Any:
    """``model`` called with keyword inputs and returning a dict: the LiteRT signature then
    carries the served names instead of ``args_0`` / ``output_0``."""
    import torch

    class Named(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, **feeds: torch.Tensor) -> dict[str, torch.Tensor]:
            result = self.inner(*(feeds[n] for n in inputs))
            results = (result,) if isinstance(result, torch.Tensor) else tuple(result)
            return dict(zip(outputs, results, strict=True))

    return Named().eval()


def _tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}


def convert(
    model: torch.nn.Module,
    example: Mapping[str, np.ndarray],
    out: pathlib.Path,
    output_names: Sequence[str] = ("output",),
    calibration: Mapping[str, np.ndarray] | None = None,
) -> pathlib.Path:
    """Write ``model`` as ``.tflite`` at the example's shapes (an edge model's batch is
    fixed; the LiteRT backend resizes it to serve batches). With ``calibration``: PT2E
    static INT8, per-channel symmetric weights, INT8 activations and INT8 inputs/outputs
    (their scale and zero point are in the file), calibrated one example-sized batch at a
    time."""
    import litert_torch
    import torch

    named = _named(model, list(example), list(output_names))
    sample = _tensors(example)
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.no_grad():
            if calibration is None:
                edge = litert_torch.convert(named, sample_kwargs=sample)
            else:
                edge = _convert_int8(named, sample, calibration)
        edge.export(str(out))
    except Exception as exc:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OptimizeError(f"LiteRT conversion of {type(model).__name__} failed: {what}") from exc
    return out


def _convert_int8(named: Any, sample: dict[str, Any], calibration: Mapping[str, np.ndarray]) -> Any:
    import litert_torch
    import torch
    from litert_torch.quantize import pt2e_quantizer as pq
    from litert_torch.quantize.quant_config import QuantConfig
    from torchao.quantization.pt2e import quantize_pt2e

    quantizer = pq.PT2EQuantizer().set_global(
        pq.get_symmetric_quantization_config(is_per_channel=True)
    )
    exported = torch.export.export(named, (), sample).module()
    prepared = quantize_pt2e.prepare_pt2e(exported, quantizer)
    batch = len(next(iter(sample.values())))
    rows = len(next(iter(calibration.values())))
    for start in range(0, rows - batch + 1, batch):
        prepared(**_tensors({k: v[start : start + batch] for k, v in calibration.items()}))
    quantized = quantize_pt2e.convert_pt2e(prepared, fold_quantize=False)
    return litert_torch.convert(
        quantized, sample_kwargs=sample, quant_config=QuantConfig(pt2e_quantizer=quantizer)
    )


def _load_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rtserve.optimize.litert_convert")
    parser.add_argument("model", help="import path 'pkg.module:name' or a .pt / .pt2 file")
    parser.add_argument("--example", required=True, help=".npz of example inputs by name")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="FP32 .tflite to write")
    parser.add_argument("--int8-out", type=pathlib.Path, help="INT8 .tflite to write as well")
    parser.add_argument("--calibration", help=".npz of calibration inputs (with --int8-out)")
    parser.add_argument("--output-name", action="append", help="output names (default: output)")
    args = parser.parse_args(argv)
    try:
        model = load_module(args.model)
        example = _load_npz(args.example)
        names = args.output_name or ["output"]
        convert(model, example, args.out, names)
        if args.int8_out:
            if not args.calibration:
                raise OptimizeError("--int8-out needs --calibration")
            convert(model, example, args.int8_out, names, _load_npz(args.calibration))
    except OptimizeError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
