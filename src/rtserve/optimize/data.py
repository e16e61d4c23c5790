"""Calibration and evaluation data: arrays by input name, checked against the model.

Accepted files:
- ``.npz``: one array per model input, keyed by input name (and optionally ``labels``);
- ``.npy``: one array, for a model with a single input;
- ``.txt``: one sentence per line, tokenized for models whose inputs are
  ``input_ids`` / ``attention_mask`` (the MiniLM tokenizer).
Labels come from the ``labels`` key of an ``.npz``, or a separate ``.npy`` / ``.txt``
(one integer per line).
"""

from __future__ import annotations

import pathlib
import zipfile
from dataclasses import dataclass

import numpy as np

from rtserve.optimize.errors import OptimizeError

_ONNX_TO_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: type
    shape: tuple[int | str | None, ...]


def model_inputs(path: pathlib.Path) -> list[InputSpec]:
    """The inputs of an ONNX file as ONNX Runtime sees them."""
    from rtserve.optimize.evaluate import open_session

    session = open_session(path, threads=1)
    specs = []
    for i in session.get_inputs():
        dtype = _ONNX_TO_NUMPY.get(i.type)
        if dtype is None:
            raise OptimizeError(f"{path}: input {i.name} has unsupported type {i.type}")
        specs.append(InputSpec(i.name, dtype, tuple(i.shape)))
    return specs


def read_sentences(path: pathlib.Path) -> list[str]:
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as exc:
        raise OptimizeError(
            f"{path}: not UTF-8 text (byte {exc.start}); one sentence per line expected"
        ) from None
    sentences = [ln for ln in lines if ln and not ln.startswith("#")]
    if not sentences:
        raise OptimizeError(f"{path} holds no sentences (one per line expected)")
    return sentences


def _read_arrays(
    path: pathlib.Path, specs: list[InputSpec], seq_len: int
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    if not path.is_file():
        raise OptimizeError(f"data file {path} {_missing(path)}")
    names = [s.name for s in specs]
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise OptimizeError(f"{path}: not a readable .npz of numeric arrays ({exc})") from None
        labels = arrays.pop("labels", None)
        missing = [n for n in names if n not in arrays]
        if missing:
            raise OptimizeError(
                f"{path} has no array for model input(s) {', '.join(missing)} "
                f"(it holds {', '.join(sorted(arrays)) or 'nothing'})"
            )
        return {n: arrays[n] for n in names}, labels
    if path.suffix == ".npy":
        if len(names) != 1:
            raise OptimizeError(
                f"{path} is a single array but the model has {len(names)} inputs "
                f"({', '.join(names)}); use an .npz keyed by input name"
            )
        try:
            return {names[0]: np.load(path, allow_pickle=False)}, None
        except (ValueError, OSError, EOFError) as exc:
            raise OptimizeError(f"{path}: not a readable .npy array ({exc})") from None
    if path.suffix == ".txt":
        if not {"input_ids", "attention_mask"} <= set(names):
            raise OptimizeError(
                f"{path} is a text file, which needs a model with inputs input_ids and "
                f"attention_mask; this model has {', '.join(names)}"
            )
        from rtserve.optimize.text import minilm_tokenize

        tokens = minilm_tokenize(read_sentences(path), seq_len=seq_len)
        return {n: tokens[n] for n in names}, None
    raise OptimizeError(f"{path}: unsupported data file type {path.suffix!r} (.npz, .npy or .txt)")


def validate(
    arrays: dict[str, np.ndarray], specs: list[InputSpec], source: str
) -> dict[str, np.ndarray]:
    """Cast to the model's dtypes; check ranks, static dims and equal row counts."""
    out: dict[str, np.ndarray] = {}
    rows: int | None = None
    for spec in specs:
        a = np.asarray(arrays[spec.name])
        if a.dtype.kind not in "biuf":  # (strings, objects, complex numbers)
            raise OptimizeError(
                f"{source}: input {spec.name} holds {a.dtype} values; expected numbers "
                f"({np.dtype(spec.dtype).name})"
            )
        if a.ndim != len(spec.shape):
            raise OptimizeError(
                f"{source}: input {spec.name} has shape {a.shape} (rank {a.ndim}) but the model "
                f"expects rank {len(spec.shape)} {list(spec.shape)}"
            )
        for axis, (got, want) in enumerate(zip(a.shape, spec.shape, strict=True)):
            if isinstance(want, int) and want > 0 and got != want and axis > 0:
                raise OptimizeError(
                    f"{source}: input {spec.name} has shape {a.shape} but the model expects "
                    f"{list(spec.shape)} (axis {axis} must be {want})"
                )
        if np.issubdtype(a.dtype, np.floating) and not np.issubdtype(spec.dtype, np.floating):
            raise OptimizeError(
                f"{source}: input {spec.name} holds {a.dtype} but the model expects {spec.dtype.__name__}"
            )
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise OptimizeError(f"{source}: input {spec.name} holds NaN or infinite values")
        if rows is not None and len(a) != rows:
            raise OptimizeError(f"{source}: inputs have different row counts ({rows} and {len(a)})")
        rows = len(a)
        out[spec.name] = np.ascontiguousarray(a.astype(spec.dtype, copy=False))
    if not rows:
        raise OptimizeError(f"{source} holds no rows")
    return out


def _missing(path: pathlib.Path) -> str:
    return "is a folder, not a file" if path.is_dir() else "does not exist"


def integer_labels(values: np.ndarray, source: str) -> np.ndarray:
    """Class indices: integers (or integral floats), flattened; else an error naming ``source``."""
    a = np.asarray(values)
    if a.dtype.kind in "iub":
        return a.astype(np.int64).reshape(-1)
    if a.dtype.kind == "f" and np.isfinite(a).all() and (a == np.round(a)).all():
        return a.astype(np.int64).reshape(-1)
    raise OptimizeError(f"{source}: labels must be integer class indices, got {a.dtype} values")


def load_labels(path: pathlib.Path) -> np.ndarray:
    if not path.is_file():
        raise OptimizeError(f"labels file {path} {_missing(path)}")
    if path.suffix == ".npy":
        try:
            raw = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise OptimizeError(f"labels file {path}: not a readable .npy array ({exc})") from None
        return integer_labels(raw, f"labels file {path}")
    try:
        return np.array([int(x) for x in path.read_text(encoding="utf-8").split()], np.int64)
    except (ValueError, UnicodeDecodeError) as exc:
        raise OptimizeError(
            f"labels file {path}: expected one integer per line (.txt) or an .npy array ({exc})"
        ) from None


def load_data(
    path: pathlib.Path,
    specs: list[InputSpec],
    labels_path: pathlib.Path | None = None,
    seq_len: int = 32,
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Arrays by input name (validated) and labels if any."""
    arrays, labels = _read_arrays(pathlib.Path(path), specs, seq_len)
    data = validate(arrays, specs, str(path))
    if labels_path is not None:
        labels = load_labels(pathlib.Path(labels_path))
    if labels is not None:
        labels = integer_labels(labels, str(labels_path or path))
        rows = len(next(iter(data.values())))
        if len(labels) != rows:
            raise OptimizeError(f"{len(labels)} labels for {rows} rows of {path}")
    return data, labels
