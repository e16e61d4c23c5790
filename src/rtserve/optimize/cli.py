"""``rtserve export`` and ``rtserve optimize`` subcommands.

Heavy modules (torch, onnxruntime) are imported inside the handlers so that other
subcommands start fast. Every :class:`OptimizeError` is printed without a traceback and
the command exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from rtserve.optimize.args import (
    at_least,
    check_folder,
    guard,
    load_module_here,
    number,
    parse_shape,
)
from rtserve.optimize.errors import OptimizeError


def cmd_export(args: argparse.Namespace) -> int:
    import numpy as np

    from rtserve.optimize.data import load_data
    from rtserve.optimize.export import export_and_verify

    if not args.input:
        raise OptimizeError(
            "give at least one --input NAME:DIMS[:DTYPE] (batch >= 2 for the example)"
        )
    at_least(args, {"given_rows": 1})
    number(args, "tolerance", 0.0, math.inf, False)
    out = pathlib.Path(args.out)
    if out.is_dir():
        raise OptimizeError(f"--out {out}: a folder; expected the .onnx file to write")
    try:
        check_folder(out.parent, "--out")
    except OptimizeError:
        raise OptimizeError(
            f"--out {out}: its folder cannot be made (a file is in the way)"
        ) from None
    model = load_module_here(args.model)
    example: dict[str, np.ndarray] = {}
    for spec in args.input:
        name, shape, dtype = parse_shape(spec)
        if name in example:
            raise OptimizeError(f"--input {spec!r}: input {name!r} is given more than once")
        if shape[0] < 2:
            shape[0] = 2
        try:
            example[name] = np.zeros(shape, dtype=np.dtype(dtype))
        except TypeError:
            raise OptimizeError(f"--input {spec!r}: unknown dtype {dtype!r}") from None
    given = []
    if args.given:
        from rtserve.optimize.data import InputSpec

        specs = [InputSpec(n, a.dtype.type, tuple(a.shape)) for n, a in example.items()]
        data, _ = load_data(pathlib.Path(args.given), specs)
        given.append({k: v[: args.given_rows] for k, v in data.items()})
    result = export_and_verify(
        model, out, example, args.output_name or ["output"], given=given,
        dynamic_axes=None if args.sequence_axis else _batch_only(example, args.output_name),
    )  # fmt: skip
    for name, diff in result.max_abs_diff.items():
        print(
            f"{out}: output {name}: max abs diff vs torch {diff:.3g} over {result.batches} batches"
        )
    if not result.ok(args.tolerance):
        print(
            f"error: max abs diff {result.worst:.3g} exceeds --tolerance {args.tolerance}",
            file=sys.stderr,
        )
        return 1
    return 0


def _batch_only(
    example: dict[str, Any], outputs: Sequence[str] | None
) -> dict[str, dict[int, str]]:
    axes = {n: {0: "batch"} for n in example}
    axes.update({n: {0: "batch"} for n in (outputs or ["output"])})
    return axes


def cmd_optimize(args: argparse.Namespace) -> int:
    from rtserve.optimize.data import load_data, model_inputs
    from rtserve.optimize.pipeline import (
        OptimizeOptions,
        TorchSources,
        parse_prune_spec,
        run_optimize,
    )
    from rtserve.optimize.publish import publish
    from rtserve.optimize.report import plot

    _check_optimize_args(args)
    model = pathlib.Path(args.model)
    out = pathlib.Path(args.out)
    work = pathlib.Path(args.work) if args.work else _default_work(out)
    check_folder(out, "--out")
    check_folder(work, "--work")
    if model.resolve() == (work / "fp32.onnx").resolve():
        raise OptimizeError(f"{model} is the work folder's own baseline copy; give another --work")
    specs = model_inputs(model)
    eval_data, labels = load_data(pathlib.Path(args.eval), specs, args.labels, args.seq_len)
    calibration = None
    if args.calibration:
        calibration, _ = load_data(pathlib.Path(args.calibration), specs, seq_len=args.seq_len)
    torch_sources = None
    if args.torch_model:
        prune_specs = [parse_prune_spec(p, args.fine_tune_epochs) for p in args.prune or []]
        train_inputs = train_labels = None
        if args.train:
            train_inputs, train_labels = load_data(
                pathlib.Path(args.train), specs, args.train_labels, args.seq_len
            )
        torch_sources = TorchSources(
            model=load_module_here(args.torch_model),
            student=load_module_here(args.student) if args.student else None,
            train_inputs=train_inputs,
            train_labels=train_labels,
            prune=prune_specs,
            distill_temperature=args.temperature,
            distill_alpha=args.alpha,
            distill_epochs=args.distill_epochs,
            qat=_qat_options(args),
        )
    options = OptimizeOptions(
        max_accuracy_drop=args.max_accuracy_drop,
        variants=args.variants.split(",") if args.variants else OptimizeOptions.variants,
        calibration_methods=args.calibration_methods.split(","),
        task=args.task,
        num_heads=args.num_heads,
        hidden_size=args.hidden_size,
        iterations=args.iterations,
        threads=args.threads,
        progress=not args.no_progress,
        noise_band=args.noise_band,
    )
    result = run_optimize(model, work, calibration, eval_data, labels, options, torch_sources)
    chosen = result.chosen.name if result.chosen else None
    table = result.table()
    png = plot(
        result.measurements, work / "report.png", f"{model.name}: accuracy vs latency", chosen
    )
    (work / "report.md").write_text(table + f"\n![accuracy vs latency]({png.name})\n")
    print(table)
    print(f"report: {work / 'report.md'} and {png}")
    asked = list(options.variants) if args.variants else []
    if asked and all(v in result.skipped for v in asked):
        print(
            f"error: none of --variants {args.variants} could be built "
            f"({'; '.join(f'{v}: {result.skipped[v]}' for v in asked)}); nothing written",
            file=sys.stderr,
        )
        return 1
    if result.chosen is None:
        print(
            f"error: no variant stays within --max-accuracy-drop {args.max_accuracy_drop}; nothing written",
            file=sys.stderr,
        )
        return 1
    dst = publish(
        out, result.chosen, result.measurements, args.max_accuracy_drop, args.max_batch_size
    )
    print(f"chose {result.chosen.name}: wrote {dst} and {out / 'config.yaml'}")
    return 0


def _default_work(out: pathlib.Path) -> pathlib.Path:
    """``optimize-out/NAME`` for ``--out REPO/NAME`` (``--out ..`` names the folder itself)."""
    return pathlib.Path("optimize-out") / (out.resolve().name or "model")


def _check_optimize_args(args: argparse.Namespace) -> None:
    """Every value checked before the run starts (a late usage error wastes minutes)."""
    at_least(args, {
        "iterations": 1, "threads": 1, "max_batch_size": 0, "seq_len": 1, "num_heads": 0,
        "hidden_size": 0, "fine_tune_epochs": 0, "distill_epochs": 1, "qat_epochs": 1,
        "qat_float_first": 0,
    })  # fmt: skip
    number(args, "max_accuracy_drop", 0.0, math.inf, False)
    number(args, "noise_band", 0.0, 10.0, False)
    number(args, "temperature", 0.0, math.inf, True)
    number(args, "alpha", 0.0, 1.0, False)
    number(args, "qat_lr", 0.0, math.inf, True)
    number(args, "qat_weight_lr", 0.0, math.inf, False)
    if args.seq_len > 4096:
        raise OptimizeError(f"--seq-len: expected at most 4096 tokens, got {args.seq_len}")
    if args.variants is not None:
        names = args.variants.split(",")
        if not all(n.strip() for n in names):
            raise OptimizeError(
                f"--variants: expected a comma list of names, got {args.variants!r}"
            )
    methods = args.calibration_methods.split(",")
    from rtserve.optimize.quantize import CALIBRATION_METHODS

    unknown = [m for m in methods if m not in CALIBRATION_METHODS]
    if unknown:
        raise OptimizeError(
            f"--calibration-methods: unknown {unknown[0]!r}; choose from "
            f"{', '.join(CALIBRATION_METHODS)}"
        )
    if not args.torch_model:
        given = [
            flag for flag, value in (
                ("--prune", args.prune), ("--qat", args.qat), ("--train", args.train),
                ("--student", args.student), ("--train-labels", args.train_labels),
                ("--fine-tune-epochs", args.fine_tune_epochs),
            ) if value
        ]  # fmt: skip
        if given:
            raise OptimizeError(
                f"{given[0]} works on the torch model behind MODEL: give --torch-model as well"
            )
    if args.fine_tune_epochs and not args.train:
        raise OptimizeError("--fine-tune-epochs fine-tunes on training data: give --train too")
    if args.train_labels and not args.train:
        raise OptimizeError("--train-labels label the --train rows: give --train too")


def _qat_options(args: argparse.Namespace) -> Any:
    """QAT settings when ``--qat`` is given (it needs ``--train``), else None."""
    if not args.qat:
        return None
    if not args.train:
        raise OptimizeError("--qat fine-tunes on training data: give --train as well")
    from rtserve.optimize.qat import QatOptions

    return QatOptions(
        epochs=args.qat_epochs, lr=args.qat_lr, weight_lr=args.qat_weight_lr,
        loss=args.qat_loss, float_first=args.qat_float_first,
    )  # fmt: skip


def _register_export(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export", help="export a PyTorch model to ONNX and verify it against torch"
    )
    p.add_argument(
        "model",
        help="import path 'pkg.module:name' (the current directory is importable) or a "
        "TorchScript (.pt) / ExportedProgram (.pt2) file",
    )
    p.add_argument("--out", required=True, help="ONNX file to write (required)")
    p.add_argument(
        "--input",
        action="append",
        help="NAME:DIMS[:DTYPE], e.g. x:2x64:float32; repeat per input (at least one; "
        "DTYPE default: float32)",
    )
    p.add_argument(
        "--output-name", action="append", help="output name(s); repeat per output (default: output)"
    )
    p.add_argument(
        "--given",
        help="data file (.npz/.npy) with real inputs to verify on as well (default: none)",
    )
    p.add_argument(
        "--given-rows",
        type=int,
        default=32,
        help="rows of --given to verify on (default: %(default)s)",
    )
    p.add_argument(
        "--sequence-axis",
        action="store_true",
        help="make axis 1 of 2-D integer inputs dynamic (default: batch axis only)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="max abs diff accepted; exit 1 above it (default: %(default)s)",
    )
    p.set_defaults(func=guard(cmd_export))


def _register_optimize(subparsers: Any) -> None:
    o = subparsers.add_parser(
        "optimize",
        help="build, measure and choose faster variants of an ONNX model",
        description="Build every variant of an FP32 ONNX model (graph-optimized, FP16, INT8 "
        "dynamic / weight-only / static, pruned, distilled), measure accuracy and latency on "
        "this machine, and write the fastest variant within the accuracy budget as a model "
        "repository entry.",
    )
    o.add_argument("model", help="the FP32 ONNX model")
    _data_args(o)
    _variant_args(o)
    _torch_args(o)
    _qat_args(o)
    _measure_args(o)
    o.set_defaults(func=guard(cmd_optimize))


def _data_args(o: argparse.ArgumentParser) -> None:
    o.add_argument(
        "--calibration",
        help="calibration data for static INT8 (.npz by input name, .npy, or .txt sentences); "
        "default: none (static INT8 is skipped)",
    )
    o.add_argument("--eval", required=True, help="evaluation data, same formats (required)")
    o.add_argument(
        "--labels",
        type=pathlib.Path,
        help="labels for --eval (.npy or .txt), for task accuracy; default: none (agreement "
        "with the FP32 outputs)",
    )
    o.add_argument(
        "--max-accuracy-drop",
        type=float,
        default=0.01,
        help="budget, in score units (0.01 = 1 point) (default: %(default)s)",
    )
    o.add_argument(
        "--out", required=True, help="REPO/NAME: where the chosen variant is written (required)"
    )
    o.add_argument("--work", help="folder for the variants (default: optimize-out/NAME)")


def _variant_args(o: argparse.ArgumentParser) -> None:
    o.add_argument(
        "--variants",
        help="comma list of fp32-opt,fp16,int8-dynamic,int8-weight,int8-static,pruned,distilled,"
        "int8-qat,ort (default: all but ort; ort adds the ORT format of the baseline and of the "
        "INT8 variants within the budget)",
    )
    o.add_argument(
        "--calibration-methods",
        default="minmax,percentile,entropy",
        help="static INT8 calibration methods to try, comma list (default: %(default)s)",
    )
    o.add_argument(
        "--task",
        choices=["classification", "embedding", "regression"],
        help="how accuracy is scored (default: inferred from the outputs and labels)",
    )
    o.add_argument(
        "--num-heads",
        type=int,
        default=0,
        help="attention heads, for transformer fusion; 0 detects (default: %(default)s)",
    )
    o.add_argument(
        "--hidden-size",
        type=int,
        default=0,
        help="hidden size, for transformer fusion; 0 detects (default: %(default)s)",
    )
    o.add_argument(
        "--seq-len", type=int, default=32, help="token length for .txt data (default: %(default)s)"
    )


def _torch_args(o: argparse.ArgumentParser) -> None:
    o.add_argument(
        "--torch-model",
        help="import path or file of the torch model behind MODEL, for pruning and "
        "distillation (default: none; those variants are skipped)",
    )
    o.add_argument(
        "--student",
        help="import path of the student to distill (needs --torch-model, --train) (default: none)",
    )
    o.add_argument("--train", help="training data for fine-tuning and distillation (default: none)")
    o.add_argument(
        "--train-labels",
        type=pathlib.Path,
        help="labels for --train (.npy or .txt) (default: none; distillation uses the "
        "teacher's outputs alone)",
    )
    o.add_argument(
        "--prune",
        action="append",
        help="METHOD:AMOUNT, e.g. magnitude:0.3 or structured:0.5; for transformer "
        "encoders structured-heads:HEADS[:FFN], the fractions of attention heads and FFN "
        "neurons to cut (FFN default: HEADS), distilled from the unpruned model on --train "
        "text for --fine-tune-epochs; repeat for several (default: none)",
    )
    o.add_argument(
        "--fine-tune-epochs",
        type=int,
        default=0,
        help="epochs of fine-tuning after pruning, needs --train (default: %(default)s)",
    )
    o.add_argument(
        "--temperature",
        type=float,
        default=4.0,
        help="distillation softmax temperature (default: %(default)s)",
    )
    o.add_argument(
        "--alpha",
        type=float,
        default=0.7,
        help="weight of the teacher's soft targets against the labels (default: %(default)s)",
    )
    o.add_argument(
        "--distill-epochs",
        type=int,
        default=60,
        help="epochs of student training (default: %(default)s)",
    )


def _qat_args(o: argparse.ArgumentParser) -> None:
    o.add_argument(
        "--qat",
        action="store_true",
        help="add the int8-qat variant: quantization-aware training of --torch-model on "
        "--train against its own FP32 logits, exported as QDQ INT8 (default: off)",
    )
    o.add_argument(
        "--qat-epochs",
        type=int,
        default=3,
        help="epochs of quantization-aware training (default: %(default)s)",
    )
    o.add_argument(
        "--qat-lr",
        type=float,
        default=1e-3,
        help="learning rate (Adam, cosine decay) of the biases in quantization-aware "
        "training (default: %(default)s)",
    )
    o.add_argument(
        "--qat-weight-lr",
        type=float,
        default=0.0,
        help="learning rate of the weights in quantization-aware training; 0 keeps the "
        "FP32 weights, which holds accuracy best on a few hundred rows (default: %(default)s)",
    )
    o.add_argument(
        "--qat-loss",
        choices=("mse", "kd"),
        default="mse",
        help="QAT loss against the FP32 logits: mse, or kd (KL at temperature 2, with "
        "--train labels if given) (default: %(default)s)",
    )
    o.add_argument(
        "--qat-float-first",
        type=int,
        default=0,
        metavar="N",
        help="keep the first N convolution / linear layers of the QAT model in float: the "
        "first layers' rounding errors travel through all others (default: %(default)s)",
    )


def _measure_args(o: argparse.ArgumentParser) -> None:
    o.add_argument(
        "--noise-band",
        type=float,
        default=0.2,
        help="a variant must be faster than the FP32 baseline at batch 1 by more than this "
        "fraction (or the run's own round-to-round spread, if wider) to be chosen "
        "(default: %(default)s)",
    )
    o.add_argument(
        "--iterations",
        type=int,
        default=100,
        help="latency runs per batch size (default: %(default)s)",
    )
    o.add_argument(
        "--threads",
        type=int,
        default=2,
        help="ONNX Runtime intra-op threads (default: %(default)s)",
    )
    o.add_argument(
        "--max-batch-size",
        type=int,
        default=32,
        help="max_batch_size written to the chosen model's config.yaml (default: %(default)s)",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bars (default: shown)")


def register(subparsers: Any) -> None:
    """Add ``export``, ``optimize``, ``early-exit``, ``edge``, ``optimize-trees`` and
    ``optimize-llm`` to an argparse subparsers action."""
    _register_export(subparsers)
    _register_optimize(subparsers)

    from rtserve.optimize.early_exit_cli import register as register_early_exit

    register_early_exit(subparsers)

    from rtserve.optimize.edge import register as register_edge

    register_edge(subparsers)

    from rtserve.optimize.llm import register as register_llm
    from rtserve.optimize.trees import register as register_trees

    register_trees(subparsers)
    register_llm(subparsers)


def main(argv: Sequence[str] | None = None) -> int:
    from rtserve.optimize.args import run_command

    return run_command(register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
