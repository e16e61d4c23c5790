"""The QAT section of the optimization report: EfficientNet-Lite0 fine-tuned with fake
quantization (``rtserve optimize --qat``), against FP32 of the same run; accuracy is top-1
agreement with FP32. ``python -m bench.showcase --only qat --out /tmp/opt-qat.md``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from bench.showcase import zoo
from rtserve.optimize.pipeline import OptimizeResult, TorchSources, ratio, run_optimize
from rtserve.optimize.qat import QatOptions

if TYPE_CHECKING:
    from bench.showcase.zoo import Settings

GOAL_SPEEDUP = 1.4
GOAL_AGREEMENT = 0.97
TRAIN_IMAGES = 256
OPTIONS = QatOptions(epochs=3, lr=1e-3, batch_size=8, float_first=5)


def run(settings: Settings) -> tuple[OptimizeResult, int]:
    """Export EfficientNet-Lite0, build and measure ``int8-qat`` next to FP32."""
    from bench.showcase.zoo import options

    work = settings.work / "efficientnet-qat"
    model = zoo.export_efficientnet_lite0(work / "source.onnx")
    eval_data = {"image": zoo.efficientnet_preprocess(zoo.sample_images(settings.n_eval_images, 1))}
    n_train = min(TRAIN_IMAGES, settings.n_eval_images)
    train = {"image": zoo.efficientnet_preprocess(zoo.sample_images(n_train, seed=3))}
    sources = TorchSources(model=zoo.efficientnet_module(), train_inputs=train, qat=OPTIONS)
    opts = options(settings, max_accuracy_drop=1 - GOAL_AGREEMENT, variants=("int8-qat",))
    result = run_optimize(model, work / "variants", None, eval_data, None, opts, sources)
    return result, n_train


def section(settings: Settings) -> str:
    """The markdown of the QAT section."""
    result, n_train = run(settings)
    m = result.get("int8-qat")
    speed = ratio(result, "int8-qat") if m else math.nan
    agreement = m.score if m else math.nan
    met = speed >= GOAL_SPEEDUP and agreement >= GOAL_AGREEMENT
    chosen = result.chosen.name if result.chosen else "none"
    verdict = "met" if met else "missed"
    lines = [
        "## EfficientNet-Lite0: quantization-aware training (`int8-qat`)",
        "",
        "`rtserve optimize --torch-model ... --train ... --qat` fine-tunes a fake-quantized copy "
        "(torch.ao FX QAT: uint8 activations, int8 per-channel weights, BatchNorm folded) against "
        "the FP32 logits and exports QDQ ONNX (`QLinearConv` / `QLinearAdd` in ONNX Runtime). The "
        f"first {OPTIONS.float_first} convolutions (`--qat-float-first`) and the classifier stay "
        f"float. Training: {n_train} images (seed 3, none among the {settings.n_eval_images} "
        f"evaluation images); ranges set on {OPTIONS.calibration_rows} and frozen; {OPTIONS.epochs} "
        f"epochs, batch {OPTIONS.batch_size}, Adam on the biases only (lr {OPTIONS.lr:g}), MSE to the "
        "FP32 logits. Static INT8 keeps convolutions float to hold the budget; QAT keeps all but "
        f"the first {OPTIONS.float_first} in INT8.",
        "",
        f"Goal: >= {GOAL_SPEEDUP}x at batch 1 with top-1 agreement >= {GOAL_AGREEMENT}: "
        f"**{verdict}** ({speed:.2f}x, agreement {agreement:.3f}). Chosen: **{chosen}**.",
        "",
        result.table(),
    ]
    return "\n".join(lines)
