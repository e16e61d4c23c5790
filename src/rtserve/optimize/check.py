"""Up-front checks of an ONNX file, so failures name the node and the operator."""

from __future__ import annotations

import pathlib
import re
from typing import Any

from rtserve.optimize.errors import OptimizeError

# Operator domains ONNX Runtime's CPU provider implements besides the standard one.
_KNOWN_DOMAINS = {"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc"}


def load_model(path: pathlib.Path | str) -> Any:
    """``onnx.load`` with errors that name the file."""
    import onnx

    p = pathlib.Path(path)
    if not p.is_file():
        raise OptimizeError(f"model file {p} does not exist")
    try:
        return onnx.load(str(p))
    except Exception as exc:
        raise OptimizeError(f"{p} is not a readable ONNX model: {exc}") from exc


def check_operators(path: pathlib.Path | str) -> None:
    """Raise if a node uses an operator ONNX Runtime cannot run, naming the first such node."""
    import onnx

    model = load_model(path)
    opsets = {o.domain: o.version for o in model.opset_import}
    for node in model.graph.node:
        label = node.name or f"(unnamed, output {node.output[0] if node.output else '?'})"
        if node.domain not in _KNOWN_DOMAINS:
            raise OptimizeError(
                f"{path}: node {label} uses operator {node.domain}::{node.op_type}, a custom "
                "domain ONNX Runtime does not implement; register it or replace the node"
            )
        if node.domain in ("", "ai.onnx"):
            version = opsets.get("", opsets.get("ai.onnx", 1))
            try:
                onnx.defs.get_schema(node.op_type, version, "")
            except Exception:
                raise OptimizeError(
                    f"{path}: node {label} uses operator {node.op_type}, which is not an ONNX "
                    f"operator at opset {version}"
                ) from None


_NODE_IN_MESSAGE = re.compile(r"node with name '([^']*)'|Node \(([^)]*)\)|node ([\w/.:-]+)")


def explain_load_failure(path: Any, exc: Exception) -> str:
    """A one-line explanation of why ONNX Runtime refused a model, naming the node if it can."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = path if isinstance(path, str | pathlib.Path) else "the model"
    if isinstance(path, str | pathlib.Path) and pathlib.Path(path).is_file():
        try:
            check_operators(path)
        except OptimizeError as found:
            return found.message
    match = _NODE_IN_MESSAGE.search(str(exc))
    if match:
        node = next(g for g in match.groups() if g)
        return f"ONNX Runtime cannot load {where}: node {node}: {text}"
    return f"ONNX Runtime cannot load {where}: {text}"
