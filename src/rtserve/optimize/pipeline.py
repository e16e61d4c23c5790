"""``rtserve optimize``: build every variant of a model, measure it, choose and publish.

The baseline is the FP32 file run by ONNX Runtime with its default (online) graph
optimization; every ratio in the report is against it, measured in the same run.
"""

from __future__ import annotations

import math
import pathlib
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rtserve.optimize import quantize
from rtserve.optimize.check import check_operators
from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.evaluate import (
    Measurement,
    Task,
    accuracy_metrics,
    infer_task,
    measure_latencies,
    measure_variant,
    open_session,
    run_batched,
)
from rtserve.optimize.prune_transformer import STRUCTURED_HEADS
from rtserve.optimize.report import NOISE_BAND, choice_note, choose, noise_band, speedup

if TYPE_CHECKING:
    import torch

    from rtserve.optimize.qat import QatOptions

ALL_VARIANTS = (
    "fp32-opt",
    "fp16",
    "int8-dynamic",
    "int8-weight",
    "int8-static",
    "pruned",
    "distilled",
    "int8-qat",
    "ort",
)
# ``ort`` (the ORT format of other variants) is asked for by name: not in the default run.
DEFAULT_VARIANTS = tuple(v for v in ALL_VARIANTS if v != "ort")


@dataclass
class PruneSpec:
    method: str  # magnitude | structured | structured-heads
    amount: float  # structured-heads: the fraction of attention heads
    fine_tune_epochs: int = 0
    ffn_amount: float | None = None  # structured-heads: FFN neurons (None: as ``amount``)
    fine_tune_seconds: float | None = None  # structured-heads: stop distilling after this

    @property
    def name(self) -> str:
        if self.method == STRUCTURED_HEADS:
            ffn = self.amount if self.ffn_amount is None else self.ffn_amount
            return f"pruned-heads-{round(self.amount * 100)}-ffn-{round(ffn * 100)}"
        return f"pruned-{self.method}-{int(self.amount * 100)}"


PRUNE_USAGE = (
    "expected magnitude:AMOUNT, structured:AMOUNT or structured-heads:HEADS[:FFN] "
    "(fractions in [0, 1), e.g. structured:0.5 or structured-heads:0.5:0.5)"
)


def parse_prune_spec(text: str, fine_tune_epochs: int = 0) -> PruneSpec:
    """``--prune`` text -> :class:`PruneSpec`; an error naming the flag and the grammar."""
    method, *amounts = text.split(":")
    if method not in ("magnitude", "structured", STRUCTURED_HEADS):
        raise OptimizeError(f"--prune {text!r}: unknown method {method!r}; {PRUNE_USAGE}")
    if not 1 <= len(amounts) <= (2 if method == STRUCTURED_HEADS else 1):
        raise OptimizeError(f"--prune {text!r}: {PRUNE_USAGE}")
    try:
        values = [float(a) for a in amounts]
    except ValueError:
        raise OptimizeError(f"--prune {text!r}: amounts must be numbers; {PRUNE_USAGE}") from None
    if any(not 0.0 <= v < 1.0 for v in values):
        raise OptimizeError(f"--prune {text!r}: amounts must be within [0, 1); {PRUNE_USAGE}")
    if method != STRUCTURED_HEADS and values[0] == 0.0:
        raise OptimizeError(f"--prune {text!r}: prunes nothing; {PRUNE_USAGE}")
    if method == STRUCTURED_HEADS and not any(values):
        raise OptimizeError(f"--prune {text!r}: prunes nothing; {PRUNE_USAGE}")
    ffn = values[1] if len(values) == 2 else None
    return PruneSpec(method, values[0], fine_tune_epochs, ffn)


@dataclass
class TorchSources:
    """Torch models for the variants made before export (pruning, distillation)."""

    model: torch.nn.Module | None = None
    student: torch.nn.Module | None = None
    train_inputs: dict[str, np.ndarray] | None = None
    train_labels: np.ndarray | None = None
    prune: list[PruneSpec] = field(default_factory=list)
    distill_temperature: float = 4.0
    distill_alpha: float = 0.7
    distill_epochs: int = 60
    qat: QatOptions | None = None  # quantization-aware training (None: no int8-qat variant)


@dataclass
class FallbackStep:
    excluded: int
    score: float
    within_budget: bool


@dataclass
class OptimizeResult:
    measurements: list[Measurement]
    reference_score: float
    baseline: str
    chosen: Measurement | None
    task: Task
    max_accuracy_drop: float
    fallback: dict[str, list[FallbackStep]] = field(default_factory=dict)
    excluded_nodes: dict[str, list[str]] = field(default_factory=dict)
    noise_band: float = 0.0
    choice_note: str = ""  # why the baseline was kept over a faster variant, if it was
    skipped: dict[str, str] = field(default_factory=dict)  # variant -> why it was not built

    def get(self, name: str) -> Measurement | None:
        return next((m for m in self.measurements if m.name == name), None)

    def table(self) -> str:
        """The markdown table of every variant, then why the baseline was kept, if it was."""
        from rtserve.optimize.report import markdown_table

        text = markdown_table(
            self.measurements, self.baseline, self.reference_score, self.max_accuracy_drop,
            self.chosen.name if self.chosen else None, self.noise_band,
        )  # fmt: skip
        text += f"\n{self.choice_note}\n" if self.choice_note else ""
        for name, why in self.skipped.items():
            text += f"\n- `{name}` not built: {why}"
        return text + ("\n" if self.skipped else "")


@dataclass
class OptimizeOptions:
    max_accuracy_drop: float = 0.01
    variants: Sequence[str] = DEFAULT_VARIANTS
    calibration_methods: Sequence[str] = ("minmax", "percentile", "entropy")
    static_op_types: Sequence[str] | None = None
    fallback_max_steps: int = 7
    task: Task | None = None
    batch_sizes: Sequence[int] = (1, 8, 32)
    iterations: int = 100
    max_seconds: float = 3.0
    rounds: int = 10
    num_heads: int = 0  # transformer fusion hints (0: detect)
    hidden_size: int = 0
    threads: int = 2
    progress: bool = True
    noise_band: float = NOISE_BAND  # speed-ups up to this fraction do not count


def _progress(enabled: bool) -> Any:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        disable=not enabled,
        transient=False,
    )


def _score(
    path: pathlib.Path,
    eval_data: Mapping[str, np.ndarray],
    reference: np.ndarray,
    task: Task,
    labels: np.ndarray | None,
    threads: int,
) -> float:
    session = open_session(path, threads=threads)
    out = run_batched(session, eval_data, batch_size=32)
    return accuracy_metrics(task, out, reference, labels)[0]


def static_with_fallback(
    src: pathlib.Path,
    work: pathlib.Path,
    name: str,
    calibration: Mapping[str, np.ndarray],
    method: str,
    eval_data: Mapping[str, np.ndarray],
    reference: np.ndarray,
    task: Task,
    labels: np.ndarray | None,
    reference_score: float,
    max_drop: float,
    op_types: Sequence[str] | None = None,
    max_steps: int = 8,
    threads: int = 2,
    ranking_memo: dict[str, list[str]] | None = None,
    max_isolated: int = 120,
) -> tuple[pathlib.Path, list[FallbackStep], list[str]]:
    """Static INT8, then keep the most sensitive nodes in float until the budget holds.

    The full INT8 model is kept as ``<name>-full.onnx``. If it misses the budget, nodes
    are ranked by sensitivity (:func:`_rank_nodes`) and :func:`fallback_search` looks for
    the fewest of them to keep in float. ``ranking_memo`` shares the ranking between
    calibration methods. Returns the model (within budget if any step was), the steps,
    and the nodes kept in float.
    """
    prepared = work / "static-prepared.onnx"
    if not prepared.exists():
        quantize.prepare_for_static(src, prepared)
    # ORT reloads entropy ranges from its cache as plain min/max: recalibrate instead.
    cache = None if method == "entropy" else work / f"{name}.calib.json"
    if cache is not None:
        cache.unlink(missing_ok=True)
    dst = work / f"{name}.onnx"

    def build(excluded: Sequence[str]) -> FallbackStep:
        quantize.quantize_static_int8(
            prepared, dst, calibration, method, op_types=op_types, nodes_to_exclude=excluded,
            cache=cache,
        )  # fmt: skip
        score = _score(dst, eval_data, reference, task, labels, threads)
        return FallbackStep(len(excluded), score, reference_score - score <= max_drop)

    first = build([])
    shutil.copyfile(dst, work / f"{name}-full.onnx")
    if first.within_budget:
        return dst, [first], []
    memo = ranking_memo if ranking_memo is not None else {}
    if "ranking" not in memo:
        memo["ranking"] = _rank_nodes(
            prepared, dst, work, name, calibration, method, cache, op_types, max_isolated
        )
    steps, excluded = fallback_search(build, memo["ranking"], max_steps)
    return dst, [first, *steps], excluded


def _rank_nodes(
    prepared: pathlib.Path,
    quantized: pathlib.Path,
    work: pathlib.Path,
    name: str,
    calibration: Mapping[str, np.ndarray],
    method: str,
    cache: pathlib.Path | None,
    op_types: Sequence[str] | None,
    max_isolated: int,
) -> list[str]:
    """Compute nodes, most sensitive to INT8 first.

    With at most ``max_isolated`` compute nodes each one is quantized alone and its error
    at the output measured (:func:`quantize.isolated_sensitivity`); otherwise the cheaper
    per-node error growth of :func:`quantize.sensitivity_ranking` is used.
    """
    from rtserve.optimize.check import load_model

    sample = {k: v[: min(32, len(v))] for k, v in calibration.items()}
    compute = [
        n.name
        for n in load_model(prepared).graph.node
        if n.op_type in quantize.COMPUTE_OPS and n.name
        and (op_types is None or n.op_type in op_types)
    ]  # fmt: skip
    if 0 < len(compute) <= max_isolated:
        probe_cache = cache or work / f"{name}.probe.calib.json"
        if cache is None:
            quantize.quantize_static_int8(
                prepared, work / "probe.onnx", calibration, "minmax", op_types=op_types,
                cache=probe_cache,
            )  # fmt: skip
        ranked = quantize.isolated_sensitivity(
            prepared, probe_cache, "minmax" if cache is None else method, sample, compute,
            work, op_types,
        )  # fmt: skip
    else:
        ranked = quantize.sensitivity_ranking(prepared, quantized, sample)
    return [n for n, _ in ranked]


def fallback_search(
    build: Callable[[Sequence[str]], FallbackStep], ranking: Sequence[str], max_steps: int
) -> tuple[list[FallbackStep], list[str]]:
    """The fewest top-ranked nodes to keep in float so that ``build`` meets the budget.

    Keeps the top 1, 2, 4, ... nodes in float until a step is within budget (at most
    ``max_steps`` steps), then bisects the count between the last miss and the first hit
    (at most 3 more steps) and rebuilds the winner last, so the model on disk is the one
    returned. Returns the steps taken and the nodes kept in float (those of the last step
    when no step met the budget).
    """
    steps: list[FallbackStep] = []
    best: tuple[int, FallbackStep] | None = None
    low, k = 0, 1
    for _ in range(max_steps):
        k = min(k, len(ranking))
        step = build(ranking[:k])
        steps.append(step)
        if step.within_budget:
            best = (k, step)
            break
        if k >= len(ranking):
            break
        low, k = k, k * 2
    if best is None:
        return steps, list(ranking[: steps[-1].excluded]) if steps else []
    high = best[0]
    for _ in range(3):  # bisect between the last miss and the first hit
        mid = (low + high) // 2
        if mid <= low or mid >= high:
            break
        step = build(ranking[:mid])
        steps.append(step)
        if step.within_budget:
            high = mid
        else:
            low = mid
    excluded = list(ranking[:high])
    if steps[-1].excluded != high:
        steps.append(build(excluded))
    return steps, excluded


def _torch_example(
    eval_data: Mapping[str, np.ndarray], input_names: Sequence[str]
) -> dict[str, np.ndarray]:
    return {n: np.ascontiguousarray(eval_data[n][:2]) for n in input_names}


@dataclass
class _Run:
    """One ``run_optimize`` call: the baseline, the data, and how every variant is measured."""

    work: pathlib.Path
    baseline: pathlib.Path
    calibration: Mapping[str, np.ndarray] | None
    eval_data: Mapping[str, np.ndarray]
    reference: np.ndarray
    labels: np.ndarray | None
    task: Task
    opts: OptimizeOptions
    torch_sources: TorchSources | None
    input_names: list[str]
    output_name: str
    transformer: bool
    result: OptimizeResult

    @property
    def fused(self) -> pathlib.Path:
        return self.work / "fp32-opt.onnx"

    def measure(self, name: str, path: pathlib.Path, notes: Sequence[str] = ()) -> Measurement:
        opts = self.opts
        m = measure_variant(
            name, path, self.eval_data, self.reference, self.task, self.labels,
            opts.batch_sizes, opts.iterations, opts.max_seconds, opts.threads, latency=False,
        )  # fmt: skip
        m.notes.extend(notes)
        return m

    def optimize_graph(self) -> pathlib.Path:
        quantize.optimize_graph(
            self.baseline, self.fused, self.transformer, self.opts.num_heads, self.opts.hidden_size
        )
        return self.fused

    def fused_or_base(self) -> pathlib.Path:
        """The transformer-fused graph for transformers (built once), else the baseline."""
        if not self.transformer:
            return self.baseline
        return self.fused if self.fused.exists() else self.optimize_graph()


def _fp32(run: _Run) -> list[Measurement]:
    return [run.measure("fp32", run.baseline, ["baseline: ORT default online optimization"])]


def _fp32_opt(run: _Run) -> list[Measurement]:
    dst = run.optimize_graph()
    note = (
        "transformer fusions (Attention, SkipLayerNorm, Gelu)"
        if run.transformer
        else "ORT extended level, offline"
    )
    return [run.measure("fp32-opt", dst, [note])]


def _fp16(run: _Run) -> list[Measurement]:
    from rtserve.optimize.fp16 import convert_fp16

    dst = convert_fp16(run.fused_or_base(), run.work / "fp16.onnx")
    return [run.measure("fp16", dst, ["FP32 IO; for GPU serving, CPU casts back to float"])]


def _int8_dynamic(run: _Run) -> list[Measurement]:
    dst = quantize.quantize_dynamic_int8(run.fused_or_base(), run.work / "int8-dynamic.onnx")
    notes = ["per-channel"]
    if not run.transformer and _has_conv(run.baseline):
        notes.append("ConvInteger is slow on CPU: not for CNNs")
    return [run.measure("int8-dynamic", dst, notes)]


def _int8_weight(run: _Run) -> list[Measurement]:
    dst = quantize.quantize_weight_only_int8(run.baseline, run.work / "int8-weight.onnx")
    return [run.measure("int8-weight", dst, ["int8 weights, float compute"])]


def _int8_static(run: _Run) -> list[Measurement]:
    """One static INT8 variant per calibration method, each through the fallback search."""
    if run.calibration is None:
        raise OptimizeError("static INT8 needs calibration data (--calibration)")
    opts, result = run.opts, run.result
    out = []
    memo: dict[str, list[str]] = {}
    for method in opts.calibration_methods:
        name = f"int8-static-{method}"
        dst, steps, excluded = static_with_fallback(
            run.baseline, run.work, name, run.calibration, method, run.eval_data, run.reference,
            run.task, run.labels, result.reference_score, opts.max_accuracy_drop,
            opts.static_op_types, opts.fallback_max_steps, opts.threads, memo,
        )  # fmt: skip
        if excluded:
            full = run.work / f"{name}-full.onnx"
            out.append(run.measure(f"{name}-full", full, ["every node INT8 (before the fallback)"]))
        result.fallback[name] = steps
        result.excluded_nodes[name] = excluded
        note = (
            f"QDQ per-channel, {len(excluded)} node(s) kept float"
            if excluded
            else "QDQ per-channel"
        )
        if not steps[-1].within_budget:
            note += f"; fallback stopped after {len(steps) - 1} step(s) over budget"
        out.append(run.measure(name, dst, [note]))
    return out


def _pruned(run: _Run) -> list[Measurement]:
    src = run.torch_sources
    if src is None or src.model is None or not src.prune:
        return []
    from rtserve.optimize.export import export_module
    from rtserve.optimize.prune import fine_tune, prune, prune_magnitude

    out = []
    for spec in src.prune:
        if spec.method == STRUCTURED_HEADS:
            out.extend(_pruned_encoder(run, spec))
            continue
        model = prune(src.model, spec.method, spec.amount)  # type: ignore[arg-type]
        notes = [f"{spec.method} {spec.amount:.0%}"]
        if spec.fine_tune_epochs and src.train_inputs is not None:
            fine_tune(
                model, src.train_inputs, src.train_labels,
                reference=src.model, epochs=spec.fine_tune_epochs,
            )  # fmt: skip
            if spec.method == "magnitude":
                prune_magnitude(model, spec.amount)
            notes.append(f"fine-tuned {spec.fine_tune_epochs} epochs")
        if spec.method == "magnitude":
            notes.append("zeros only: dense kernels, no speed-up")
        name = spec.name
        example = _torch_example(run.eval_data, run.input_names)
        dst = export_module(model, run.work / f"{name}.onnx", example, [run.output_name])
        out.append(run.measure(name, dst, notes))
    return out


def _pruned_encoder(run: _Run, spec: PruneSpec) -> list[Measurement]:
    """Heads and FFN neurons cut out of a transformer encoder, distilled, then also INT8.

    Importance is measured on the first 128 rows of the training (else calibration) data;
    with ``fine_tune_epochs`` the pruned model is trained on the unpruned one's outputs on
    the training data (no labels needed): layer by layer first, then end to end for the
    rest of the epochs and time; else its shrunk projections are refitted by least
    squares on those rows.
    """
    from rtserve.optimize.export import export_module
    from rtserve.optimize.prune_transformer import prune_encoder

    src = run.torch_sources
    assert src is not None and src.model is not None
    data = src.train_inputs if src.train_inputs is not None else run.calibration
    if data is None:
        raise OptimizeError(
            f"{spec.name}: head and neuron importance needs unlabelled inputs (--train or "
            "--calibration)"
        )
    ffn = spec.amount if spec.ffn_amount is None else spec.ffn_amount
    sample = {k: np.asarray(v)[:128] for k, v in data.items()}
    tune = bool(spec.fine_tune_epochs and src.train_inputs is not None)
    # Seen on MiniLM: the refit lifts cosine 0.76 -> 0.83 untrained, but ~40 distillation
    # steps from it reached 0.83 against 0.86 from the plain cut: refit only when not tuning.
    model, summary = prune_encoder(src.model, sample, spec.amount, ffn, refit=not tune)
    notes = [summary.describe(), *summary.notes]
    if tune:
        assert src.train_inputs is not None
        model = _recover_encoder(model, src.model, src.train_inputs, spec, notes)
    else:
        notes.append("not fine-tuned")
    example = _torch_example(run.eval_data, run.input_names)
    dst = export_module(model, run.work / f"{spec.name}.onnx", example, [run.output_name])
    int8 = quantize.quantize_dynamic_int8(dst, run.work / f"{spec.name}-int8.onnx")
    return [
        run.measure(spec.name, dst, notes),
        run.measure(f"{spec.name}-int8", int8, [*notes, "then INT8 dynamic, per-channel"]),
    ]


def _recover_encoder(
    model: Any,
    teacher: Any,
    train: Mapping[str, np.ndarray],
    spec: PruneSpec,
    notes: list[str],
) -> Any:
    """Layer-wise reconstruction (up to half the time), then end-to-end distillation.

    Seen on MiniLM at 0.5:0.5: three layer-wise epochs take the cosine 0.77 -> 0.92 in
    about two minutes, where end-to-end distillation alone reached 0.88 in four and a half.
    """
    from rtserve.optimize.prune_transformer import (
        LAYERWISE_EPOCHS,
        distill_encoder,
        reconstruct_layers,
    )

    start = time.perf_counter()
    budget = spec.fine_tune_seconds
    model, layerwise = reconstruct_layers(
        model, teacher, train, epochs=min(spec.fine_tune_epochs, LAYERWISE_EPOCHS),
        max_seconds=None if budget is None else budget / 2,
    )  # fmt: skip
    notes.append(layerwise.describe())
    left = None if budget is None else max(0.0, budget - (time.perf_counter() - start))
    model, fit = distill_encoder(
        model, teacher, train, epochs=spec.fine_tune_epochs, max_seconds=left, dropout=False
    )
    notes.append(
        f"then distilled end to end {fit.steps} steps of {fit.planned} "
        f"({fit.epochs:.1f} epochs), {fit.seconds:.0f} s"
    )
    return model


def _distilled(run: _Run) -> list[Measurement]:
    src = run.torch_sources
    if src is None or src.model is None or src.student is None or src.train_inputs is None:
        return []
    from rtserve.optimize.distill import distill
    from rtserve.optimize.export import export_module

    if len(src.train_inputs) != 1:
        raise OptimizeError("distillation supports single-input models")
    x = next(iter(src.train_inputs.values()))
    student = distill(
        src.model, src.student, x, src.train_labels,
        src.distill_temperature, src.distill_alpha, src.distill_epochs,
    )  # fmt: skip
    example = _torch_example(run.eval_data, run.input_names)
    dst = export_module(student, run.work / "distilled.onnx", example, [run.output_name])
    params = sum(p.numel() for p in student.parameters())
    notes = [f"student {params:,} params, T={src.distill_temperature}, alpha={src.distill_alpha}"]
    return [run.measure("distilled", dst, notes)]


def _int8_qat(run: _Run) -> list[Measurement]:
    """Quantization-aware training from the torch model, exported as QDQ ONNX."""
    src = run.torch_sources
    if src is None or src.model is None or src.qat is None:
        return []
    if src.train_inputs is None:
        raise OptimizeError("quantization-aware training needs training data (--train)")
    from rtserve.optimize import qat

    example = _torch_example(run.eval_data, run.input_names)
    model, info = qat.train(src.model, src.train_inputs, src.train_labels, example, src.qat)
    dst = qat.export_qdq(model, run.work / "int8-qat.onnx", example, [run.output_name])
    return [run.measure("int8-qat", dst, [info.describe()])]


def _ort(run: _Run) -> list[Measurement]:
    """The ORT format (``.ort``: edge and minimal builds) of the baseline and of each INT8
    variant built so far within the accuracy budget, measured as ``ort-<variant>``."""
    from rtserve.optimize.edge import convert_to_ort, this_platform

    result = run.result
    sources = [
        m
        for m in result.measurements
        if m.path.endswith(".onnx")
        and (m.name == result.baseline or m.name.startswith("int8-"))
        and result.reference_score - m.score <= run.opts.max_accuracy_drop
    ]
    staging, out = run.work / "ort-staging", run.work / "ort"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for m in sources:
        shutil.copyfile(m.path, staging / f"{m.name}.onnx")
        data = pathlib.Path(m.path + ".data")
        if data.is_file():
            raise OptimizeError(f"{m.name}: external data is not supported by the ORT format")
    convert_to_ort(staging, out, this_platform())
    note = f"ORT format of {{}} ({this_platform()} optimizations baked in; minimal builds)"
    return [
        run.measure(f"ort-{m.name}", out / f"{m.name}.ort", [note.format(m.name)]) for m in sources
    ]


BUILDERS: dict[str, Callable[[_Run], list[Measurement]]] = {
    "fp32-opt": _fp32_opt,
    "fp16": _fp16,
    "int8-dynamic": _int8_dynamic,
    "int8-weight": _int8_weight,
    "int8-static": _int8_static,
    "pruned": _pruned,
    "distilled": _distilled,
    "int8-qat": _int8_qat,
    "ort": _ort,
}


def _prepare(
    model_path: pathlib.Path,
    work: pathlib.Path,
    calibration: Mapping[str, np.ndarray] | None,
    eval_data: Mapping[str, np.ndarray],
    labels: np.ndarray | None,
    opts: OptimizeOptions,
    torch_sources: TorchSources | None,
) -> _Run:
    """Check the model, copy it as the baseline and compute the reference outputs."""
    unknown = set(opts.variants) - set(ALL_VARIANTS)
    if unknown:
        raise OptimizeError(
            f"unknown variant(s) {', '.join(sorted(unknown))}; choose from {', '.join(ALL_VARIANTS)}"
        )
    check_operators(model_path)
    work.mkdir(parents=True, exist_ok=True)
    baseline = work / "fp32.onnx"
    shutil.copyfile(model_path, baseline)
    session = open_session(baseline, threads=opts.threads)
    input_names = [i.name for i in session.get_inputs()]
    output_name = session.get_outputs()[0].name
    missing = [n for n in input_names if n not in eval_data]
    if missing:
        raise OptimizeError(f"evaluation data lacks model input(s) {', '.join(missing)}")
    reference = run_batched(session, eval_data, batch_size=32)
    del session
    task: Task = opts.task or infer_task(reference, output_name, labels)
    if task == "classification" and reference.ndim == 2:
        _check_label_range(labels, reference.shape[1], "--labels")
        if torch_sources is not None:
            _check_label_range(torch_sources.train_labels, reference.shape[1], "--train-labels")
    ref_score = accuracy_metrics(task, reference, reference, labels)[0]
    return _Run(
        work=work, baseline=baseline, calibration=calibration, eval_data=eval_data,
        reference=reference, labels=labels, task=task, opts=opts, torch_sources=torch_sources,
        input_names=input_names, output_name=output_name,
        transformer=quantize.is_transformer(model_path),
        result=OptimizeResult([], ref_score, "fp32", None, task, opts.max_accuracy_drop),
    )  # fmt: skip


def _check_label_range(labels: np.ndarray | None, classes: int, flag: str) -> None:
    if labels is not None and len(labels) and (labels.min() < 0 or labels.max() >= classes):
        bad = int(labels.min() if labels.min() < 0 else labels.max())
        raise OptimizeError(
            f"{flag}: label {bad} is not a class of the model's {classes} outputs "
            f"(expected 0 to {classes - 1})"
        )


def run_optimize(
    model_path: pathlib.Path,
    work: pathlib.Path,
    calibration: Mapping[str, np.ndarray] | None,
    eval_data: Mapping[str, np.ndarray],
    labels: np.ndarray | None = None,
    options: OptimizeOptions | None = None,
    torch_sources: TorchSources | None = None,
    log: Callable[[str], None] = print,
) -> OptimizeResult:
    """Build and measure the requested variants of ``model_path`` in ``work``.

    The FP32 baseline comes first; a variant that cannot be built (an
    :class:`OptimizeError`) is logged and skipped. Latencies of every variant are then
    measured in alternating rounds, and the fastest variant within the budget is chosen.
    """
    model_path = pathlib.Path(model_path)
    opts = options or OptimizeOptions()
    run = _prepare(model_path, work, calibration, eval_data, labels, opts, torch_sources)
    result = run.result
    jobs = [("fp32", _fp32)] + [(v, BUILDERS[v]) for v in ALL_VARIANTS if v in opts.variants]
    with _progress(opts.progress) as bar:
        task_id = bar.add_task(f"optimizing {model_path.name}", total=len(jobs))
        for name, job in jobs:
            bar.update(task_id, description=f"{model_path.name}: {name}")
            try:
                result.measurements.extend(job(run))
            except OptimizeError as exc:
                if name == "fp32":
                    raise
                log(f"variant {name} skipped: {exc.message}")
                result.skipped[name] = exc.message
            bar.advance(task_id)
        bar.update(
            task_id, description=f"{model_path.name}: latency, {opts.rounds} alternating rounds"
        )
        measure_latencies(
            result.measurements, eval_data, opts.batch_sizes, opts.rounds,
            opts.iterations, opts.max_seconds, opts.threads,
        )  # fmt: skip
    result.noise_band = noise_band(result.get(result.baseline), opts.noise_band)
    args = (result.measurements, result.reference_score, opts.max_accuracy_drop)
    result.chosen = choose(*args, result.baseline, result.noise_band)
    result.choice_note = choice_note(*args, result.baseline, result.noise_band)
    return result


def _has_conv(path: pathlib.Path) -> bool:
    from rtserve.optimize.check import load_model

    return any(n.op_type == "Conv" for n in load_model(path).graph.node)


def ratio(result: OptimizeResult, name: str, batch: int | None = None) -> float:
    """Speed-up of ``name`` over the baseline at batch 1 (p50), or in rows/s at ``batch``:
    the median of the round-by-round ratios (``report.speedup``)."""
    base, m = result.get(result.baseline), result.get(name)
    if base is None or m is None:
        return math.nan
    return speedup(base, m, batch)
