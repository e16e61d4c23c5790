"""The edge table of the optimization report: each model as the files that ship to devices
(ONNX Runtime's ``.ort``, LiteRT's ``.tflite``; FP32 and static INT8), measured by
:func:`rtserve.optimize.edge.export_edge` on the runtime that runs them there, at batch 1
and 1 thread.

    python -m bench.showcase --only edge --out /tmp/opt-edge.md    # this section alone

LiteRT conversion needs litert-torch, here or in the converter venv (``make
edge-converter``); without it the LiteRT rows are left out and the section says so.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bench.report import markdown_table
from bench.showcase import zoo
from bench.workloads import ROOT
from rtserve.optimize.edge import CONVERTER_ENV, EdgeRequest, EdgeResult, export_edge

if TYPE_CHECKING:
    from bench.showcase.zoo import Settings

CONVERTER = ROOT / "bench" / ".peers" / "litert" / "bin" / "python"
THREADS = 1


def converter() -> str | None:
    """The python that converts to LiteRT, or ``None`` when there is none."""
    if importlib.util.find_spec("litert_torch") is not None:
        return ""
    found = os.environ.get(CONVERTER_ENV) or (str(CONVERTER) if CONVERTER.exists() else "")
    return found or None


def _request(
    fmt: str, out: pathlib.Path, data: dict[str, Any], settings: Settings, python: str | None
) -> EdgeRequest:
    return EdgeRequest(
        fmt=fmt,
        out=out,
        example={k: v[:1] for k, v in data["eval"].items()},
        output_names=["logits"],
        eval_data=data["eval"],
        labels=data.get("labels"),
        calibration=data["calib"],
        converter_python=python or None,
        threads=(THREADS,),
        iterations=max(60, settings.iterations),
        rounds=5,
    )


def _digits(settings: Settings) -> tuple[Any, dict[str, Any]]:
    import torch

    data = zoo.digits_data(seed=0)
    torch.manual_seed(0)
    teacher = zoo.train_digits_teacher(data, epochs=10)  # the edge table needs no more
    return teacher, {
        "eval": {"x": data["x_test"]},
        "labels": data["y_test"],
        "calib": {"x": data["x_calib"]},
    }


def _efficientnet(settings: Settings) -> tuple[Any, dict[str, Any]]:
    n_eval = min(settings.n_eval_images, 200)
    n_calib = min(settings.n_calib_images, 64)
    return zoo.efficientnet_module(), {
        "eval": {"image": zoo.efficientnet_preprocess(zoo.sample_images(n_eval, seed=1))},
        "calib": {"image": zoo.efficientnet_preprocess(zoo.sample_images(n_calib, seed=2))},
    }


MODELS = {
    "Digits MLP (64-1024-1024-512-10, 10 epochs)": _digits,
    "EfficientNet-Lite0": _efficientnet,
}


def measure_model(
    name: str, settings: Settings, python: str | None
) -> tuple[list[EdgeResult], dict[str, Any]]:
    """Every edge file of one model: ONNX FP32 (the server's reference), ORT and LiteRT."""
    model, data = MODELS[name](settings)
    work = settings.work / "edge" / name.split()[0].lower()
    results = export_edge(model, _request("ort", work / "ort", data, settings, python))
    if python is not None:
        results += export_edge(model, _request("litert", work / "litert", data, settings, python))
    return results, data


def table(name: str, results: Sequence[EdgeResult], data: dict[str, Any], seconds: float) -> str:
    base = next(r for r in results if r.name == "onnx-fp32")
    rows = len(next(iter(data["eval"].values())))
    labelled = data.get("labels") is not None
    head = ["file", "runtime", "size", "load (ms)", "p50 b1 (ms)", "p99 b1 (ms)"]
    head += ["speed-up vs ONNX FP32", "top-1 agreement with FP32"]
    head += ["accuracy (labels)"] if labelled else []
    table = []
    for r in results:
        p50, p99 = r.latency_ms[THREADS]
        cells = [f"`{r.name}` ({pathlib.Path(r.path).name})", _runtime(r.format)]
        cells += [f"{r.size_bytes / 1e6:.2f} MB", f"{r.load_ms:.1f}", f"{p50:.3f}", f"{p99:.3f}"]
        cells += [f"{base.latency_ms[THREADS][0] / p50:.2f}x", f"{r.metrics['top1_agreement']:.4f}"]
        table.append(cells + ([f"{r.score:.4f}"] if labelled else []))
    lines = [f"**{name}** ({rows} evaluation rows; export and measurement {seconds:.0f} s)", "",
             *markdown_table(head, table)]  # fmt: skip
    return "\n".join(lines) + "\n"


def _runtime(fmt: str) -> str:
    return {"litert": "LiteRT interpreter", "ort": "ONNX Runtime (.ort)"}.get(
        fmt, "ONNX Runtime (.onnx)"
    )


def section(settings: Settings) -> str:
    """The report's edge section (Markdown)."""
    from bench.showcase.zoo import version_of

    python = converter()
    parts = [
        "## Edge formats (LiteRT and ONNX Runtime's ORT format)",
        "",
        "Each model written by `rtserve export-edge` and measured by the runtime that runs it on "
        "the device: ONNX Runtime on the `.ort` (FP32, static INT8 QDQ) and the LiteRT interpreter "
        f"(`ai-edge-litert` {version_of('ai-edge-litert')}) on the `.tflite` (FP32, PT2E static "
        "INT8 from `litert-torch` 0.10, FP32 in and out as the server converts). Batch 1, 1 "
        "thread, 5 alternating rounds (p50: least disturbed round; p99: all). Load: median of 3 "
        "opens in a warm process. Reference: ONNX FP32 (the torch model for LiteRT).",
        "",
        "```",
        "rtserve export-edge mypkg.models:build --format litert --input x:1x64 "
        "--int8 --calibration calib.npz --eval eval.npz --out edge/litert",
        "rtserve export-edge model.onnx --format ort --int8 --calibration calib.npz --out edge/ort",
        "```",
        "",
    ]
    if python is None:
        parts += [
            "LiteRT rows left out: litert-torch is not installed (`make edge-converter`).",
            "",
        ]
    for name in MODELS:
        start = time.perf_counter()
        results, data = measure_model(name, settings, python)
        parts.append(table(name, results, data, time.perf_counter() - start))
    return "\n".join(parts) + "\n"
