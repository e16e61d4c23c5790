"""Structured pruning of transformer encoders: remove attention heads and FFN neurons.

Works on BERT-style encoder layers (``attention.self.{query,key,value}``,
``attention.output.dense``, ``intermediate.dense``, ``output.dense``: BERT, MiniLM,
RoBERTa, ELECTRA in transformers). The weights of a removed head or neuron are cut out of
the matrices, so the exported ONNX model holds smaller dense matrices and runs faster.

- Head importance: the loss in output cosine (against the unpruned model) when that head
  alone is removed, on unlabelled inputs. Heads are ranked across all layers; every layer
  keeps at least one.
- Neuron importance: mean absolute activation on real tokens times the norm of the
  neuron's outgoing weights (its average contribution to the layer output); the same
  fraction is removed in every layer, so all FFNs stay one size.
- Recovery (no labels): :func:`reconstruct_layers` trains each pruned layer alone to
  reproduce the unpruned model's output of that layer, cheaply, layer after layer; then
  :func:`distill_encoder` trains the whole model on the unpruned model's outputs and
  per-layer hidden states.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rtserve.optimize.errors import OptimizeError

if TYPE_CHECKING:
    import torch

STRUCTURED_HEADS = "structured-heads"
# Layer-wise epochs before end-to-end distillation: on MiniLM the gain flattens after ~3.
LAYERWISE_EPOCHS = 3


@dataclass(frozen=True)
class EncoderLayer:
    """The parts of one encoder layer that head and neuron pruning rewrite."""

    module: torch.nn.Module
    attention: torch.nn.Module
    query: torch.nn.Linear
    key: torch.nn.Linear
    value: torch.nn.Linear
    attn_out: torch.nn.Linear
    ffn_in: torch.nn.Linear
    ffn_out: torch.nn.Linear
    head_size: int

    @property
    def heads(self) -> int:
        return self.query.out_features // self.head_size

    @property
    def neurons(self) -> int:
        return self.ffn_in.out_features


@dataclass
class PruneSummary:
    """What :func:`prune_encoder` removed: heads kept per layer, FFN size, parameters."""

    heads_before: list[int]
    heads_after: list[int]
    ffn_before: int
    ffn_after: list[int]
    params_before: int
    params_after: int
    seconds: float = 0.0
    fine_tune_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        heads = f"heads {sum(self.heads_before)} -> {sum(self.heads_after)}"
        per_layer = "/".join(str(h) for h in self.heads_after)
        ffn = f"FFN {self.ffn_before} -> {max(self.ffn_after)}"
        params = f"params {self.params_before / 1e6:.1f}M -> {self.params_after / 1e6:.1f}M"
        return f"{heads} ({per_layer}), {ffn}, {params}"


def _linear(obj: Any, path: str) -> torch.nn.Linear | None:
    import torch

    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.nn.Linear) else None


def _head_size(attention: torch.nn.Module, query: torch.nn.Linear) -> int:
    size = getattr(attention, "attention_head_size", None)
    if isinstance(size, int) and size > 0:
        return size
    heads = getattr(attention, "num_attention_heads", None)
    if isinstance(heads, int) and heads > 0:
        return query.out_features // heads
    raise OptimizeError(f"{type(attention).__name__}: cannot tell the attention head size")


def encoder_layers(model: torch.nn.Module) -> list[EncoderLayer]:
    """The BERT-style encoder layers of ``model``, in order; an error if there are none."""
    layers = []
    for module in model.modules():
        parts = {
            p: _linear(module, p)
            for p in (
                "attention.self.query",
                "attention.self.key",
                "attention.self.value",
                "attention.output.dense",
                "intermediate.dense",
                "output.dense",
            )
        }
        if any(v is None for v in parts.values()):
            continue
        attention = module.get_submodule("attention.self")
        query = parts["attention.self.query"]
        assert query is not None
        layers.append(
            EncoderLayer(
                module, attention, query, parts["attention.self.key"],  # type: ignore[arg-type]
                parts["attention.self.value"], parts["attention.output.dense"],  # type: ignore[arg-type]
                parts["intermediate.dense"], parts["output.dense"],  # type: ignore[arg-type]
                _head_size(attention, query),
            )
        )  # fmt: skip
    if not layers:
        inner = next((type(m).__name__ for m in model.modules() if hasattr(m, "config")), "")
        name = f"{type(model).__name__} ({inner})" if inner else type(model).__name__
        raise OptimizeError(
            f"{name} has no BERT-style encoder layer (attention.self.query/key/value, "
            "attention.output.dense, intermediate.dense, output.dense) to prune; BERT, "
            "RoBERTa, XLM-RoBERTa, ELECTRA and MiniLM have them"
        )
    uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    if any(uses[id(la.module)] > 1 for la in layers):
        raise OptimizeError(
            f"{type(model).__name__}: an encoder layer module is used at several depths "
            "(shared weights, as in ALBERT); structured pruning needs one module per layer"
        )
    return layers


def _rows(linear: torch.nn.Linear, keep: torch.Tensor) -> torch.nn.Linear:
    """A copy of ``linear`` with only the output features ``keep``."""
    import torch

    new = torch.nn.Linear(linear.in_features, len(keep), bias=linear.bias is not None)
    new.weight.data.copy_(linear.weight.data[keep])
    if linear.bias is not None and new.bias is not None:
        new.bias.data.copy_(linear.bias.data[keep])
    return new


def _cols(linear: torch.nn.Linear, keep: torch.Tensor) -> torch.nn.Linear:
    """A copy of ``linear`` with only the input features ``keep``."""
    import torch

    new = torch.nn.Linear(len(keep), linear.out_features, bias=linear.bias is not None)
    new.weight.data.copy_(linear.weight.data[:, keep])
    if linear.bias is not None and new.bias is not None:
        new.bias.data.copy_(linear.bias.data)
    return new


def _set(root: torch.nn.Module, path: str, value: torch.nn.Module) -> None:
    owner_path, _, name = path.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    setattr(owner, name, value)


def keep_heads(layer: EncoderLayer, heads: list[int]) -> EncoderLayer:
    """Cut every head but ``heads`` out of ``layer``; returns the rewritten layer."""
    import torch

    if not heads:
        raise OptimizeError("an encoder layer must keep at least one attention head")
    idx = torch.cat(
        [torch.arange(h * layer.head_size, (h + 1) * layer.head_size) for h in sorted(heads)]
    )
    m = layer.module
    for path in ("attention.self.query", "attention.self.key", "attention.self.value"):
        _set(m, path, _rows(m.get_submodule(path), idx))  # type: ignore[arg-type]
    _set(m, "attention.output.dense", _cols(layer.attn_out, idx))
    setattr(layer.attention, "num_attention_heads", len(heads))  # noqa: B010
    setattr(layer.attention, "all_head_size", len(heads) * layer.head_size)  # noqa: B010
    return encoder_layers(m)[0]


def keep_neurons(layer: EncoderLayer, neurons: list[int]) -> EncoderLayer:
    """Cut every FFN neuron but ``neurons`` out of ``layer``; returns the rewritten layer."""
    import torch

    if not neurons:
        raise OptimizeError("an encoder layer must keep at least one FFN neuron")
    idx = torch.tensor(sorted(neurons), dtype=torch.long)
    _set(layer.module, "intermediate.dense", _rows(layer.ffn_in, idx))
    _set(layer.module, "output.dense", _cols(layer.ffn_out, idx))
    return encoder_layers(layer.module)[0]


def _as_tensors(inputs: Mapping[str, np.ndarray]) -> list[torch.Tensor]:
    import torch

    return [torch.from_numpy(np.ascontiguousarray(v)) for v in inputs.values()]


def _forward(model: torch.nn.Module, tensors: list[torch.Tensor], batch: int) -> torch.Tensor:
    import torch

    with torch.no_grad():
        outs = [
            model(*(t[i : i + batch] for t in tensors)) for i in range(0, len(tensors[0]), batch)
        ]
    return torch.cat(outs)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    import torch.nn.functional as F

    return float(F.cosine_similarity(a.flatten(1), b.flatten(1), dim=1).mean())


def head_importance(
    model: torch.nn.Module, inputs: Mapping[str, np.ndarray], batch: int = 32
) -> np.ndarray:
    """[layers, heads]: 1 - mean output cosine to the intact model with that head removed.

    A head is removed by zeroing its value rows (weights and bias): its context vector
    becomes zero, which is what cutting it out does.
    """
    import torch

    tensors = _as_tensors(inputs)
    model.eval()
    reference = _forward(model, tensors, batch)
    layers = encoder_layers(model)
    scores = np.zeros((len(layers), max(la.heads for la in layers)), dtype=np.float64)
    for i, layer in enumerate(layers):
        value = layer.value
        for h in range(layer.heads):
            rows = slice(h * layer.head_size, (h + 1) * layer.head_size)
            saved_w = value.weight.data[rows].clone()
            saved_b = value.bias.data[rows].clone() if value.bias is not None else None
            with torch.no_grad():
                value.weight.data[rows] = 0
                if value.bias is not None:
                    value.bias.data[rows] = 0
                scores[i, h] = 1.0 - _cosine(_forward(model, tensors, batch), reference)
                value.weight.data[rows] = saved_w
                if value.bias is not None and saved_b is not None:
                    value.bias.data[rows] = saved_b
    return scores


def head_norms(
    model: torch.nn.Module, inputs: Mapping[str, np.ndarray], batch: int = 32
) -> np.ndarray:
    """[layers, heads]: mean norm, on real tokens, of each head's contribution to the output.

    A head's contribution is its context vector times its slice of the attention output
    matrix; one forward pass measures all heads (ablation takes one per head).
    """
    import torch

    layers = encoder_layers(model)

    def per_head(i: int, act: torch.Tensor) -> torch.Tensor:
        la = layers[i]
        w = la.attn_out.weight.data.reshape(la.attn_out.out_features, la.heads, la.head_size)
        ctx = act.reshape(act.shape[0], la.heads, la.head_size)
        return torch.einsum("thd,ohd->tho", ctx, w).norm(dim=-1).sum(0)

    sums = _collect(model, inputs, [la.attn_out for la in layers], per_head, batch)
    rows = [np.asarray(s / n, dtype=np.float64) for s, n in sums]
    out = np.zeros((len(rows), max(len(r) for r in rows)))  # (layers may have fewer heads)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _collect(
    model: torch.nn.Module,
    inputs: Mapping[str, np.ndarray],
    modules: list[torch.nn.Module],
    reduce: Callable[[int, torch.Tensor], torch.Tensor],
    batch: int,
) -> list[tuple[np.ndarray, int]]:
    """Per module: the sum of ``reduce(i, input rows)`` over real tokens, and the token count."""
    return [
        (reduce(i, x).double().numpy(), max(len(x), 1))
        for i, x in enumerate(inputs_of(model, inputs, modules, batch))
    ]


def inputs_of(
    model: torch.nn.Module,
    inputs: Mapping[str, np.ndarray],
    modules: list[torch.nn.Module],
    batch: int = 32,
) -> list[torch.Tensor]:
    """Per module: its first input on every real token of ``inputs``, [tokens, features]."""
    import torch

    seen: list[list[torch.Tensor]] = [[] for _ in modules]
    mask_all = _token_mask(inputs)
    current: dict[str, torch.Tensor | None] = {"mask": None}

    def hook(i: int) -> Callable[..., None]:
        def record(_m: Any, args: tuple[torch.Tensor, ...]) -> None:
            act = args[0].detach()
            mask = current["mask"]
            act = act[mask] if mask is not None and act.dim() == 3 else act
            seen[i].append(act.reshape(-1, act.shape[-1]))

        return record

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(modules)]
    tensors = _as_tensors(inputs)
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(tensors[0]), batch):
                if mask_all is not None:
                    current["mask"] = torch.from_numpy(mask_all[start : start + batch])
                model(*(t[start : start + batch] for t in tensors))
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(s) for s in seen]


# The output projections that pruning shrinks, each with the LayerNorm that follows it.
_PROJECTIONS = (
    ("attention.output.dense", "attention.output.LayerNorm"),
    ("output.dense", "output.LayerNorm"),
)


def refit_projections(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    inputs: Mapping[str, np.ndarray],
    batch: int = 32,
    ridge: float = 1e-2,
) -> bool:
    """Re-solve the pruned output projections by least squares against the teacher.

    Layer by layer, each shrunk projection (attention output, FFN output) is fitted so
    that projection + residual, the LayerNorm's input, matches the teacher's LayerNorm
    input on the same tokens: it makes up for the cut heads and neurons and for the error
    that earlier layers pass on. A ridge term (``ridge`` x mean of the Gram diagonal)
    keeps the solve stable. Returns False (nothing changed) for layers without these
    LayerNorms.
    """
    s_layers, t_layers = encoder_layers(student), encoder_layers(teacher)
    try:
        t_norms = [la.module.get_submodule(ln) for la in t_layers for _, ln in _PROJECTIONS]
        pairs = [
            (la.module.get_submodule(lin), la.module.get_submodule(ln))
            for la in s_layers
            for lin, ln in _PROJECTIONS
        ]
    except AttributeError:
        return False
    targets = inputs_of(teacher, inputs, t_norms, batch)
    for (linear, norm), target in zip(pairs, targets, strict=True):
        x, pre_norm = inputs_of(student, inputs, [linear, norm], batch)
        residual = pre_norm - linear(x)
        _solve_into(linear, x, target - residual, ridge)  # type: ignore[arg-type]
    return True


def _solve_into(linear: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, ridge: float) -> None:
    """Set ``linear`` to the ridge least-squares fit of ``y`` from ``x`` (bias included)."""
    import torch

    x1 = torch.cat([x, torch.ones(len(x), 1)], dim=1).double()
    gram = x1.T @ x1
    gram += ridge * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
    w = torch.linalg.solve(gram, x1.T @ y.double())
    with torch.no_grad():
        linear.weight.copy_(w[:-1].T.float())
        if linear.bias is not None:
            linear.bias.copy_(w[-1].float())


def _token_mask(inputs: Mapping[str, np.ndarray]) -> np.ndarray | None:
    mask = inputs.get("attention_mask")
    return None if mask is None else np.asarray(mask, dtype=bool)


def neuron_importance(
    model: torch.nn.Module, inputs: Mapping[str, np.ndarray], batch: int = 32
) -> list[np.ndarray]:
    """Per layer, per FFN neuron: mean |activation| on real tokens x norm of its out-weights."""
    layers = encoder_layers(model)
    sums = _collect(
        model, inputs, [la.ffn_out for la in layers], lambda _i, act: act.abs().sum(0), batch
    )
    return [
        s / n * la.ffn_out.weight.data.norm(dim=0).double().numpy()
        for (s, n), la in zip(sums, layers, strict=True)
    ]


def _heads_to_keep(scores: np.ndarray, counts: list[int], fraction: float) -> list[list[int]]:
    """Drop the ``fraction`` least important heads across layers; each layer keeps one."""
    total = sum(counts)
    n_drop = int(round(total * fraction))
    order = sorted(
        ((scores[i, h], i, h) for i, c in enumerate(counts) for h in range(c)),
        key=lambda t: t[0],
    )
    keep = [set(range(c)) for c in counts]
    dropped = 0
    for _, i, h in order:
        if dropped >= n_drop:
            break
        if len(keep[i]) > 1:
            keep[i].discard(h)
            dropped += 1
    return [sorted(k) for k in keep]


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def prune_encoder(
    model: torch.nn.Module,
    inputs: Mapping[str, np.ndarray],
    heads: float,
    ffn: float,
    batch: int = 32,
    importance: str = "norm",
    refit: bool = True,
) -> tuple[torch.nn.Module, PruneSummary]:
    """A copy of ``model`` with the ``heads`` fraction of heads and ``ffn`` of FFN neurons cut.

    ``inputs`` are unlabelled model inputs (e.g. token ids and attention mask of some
    sentences) on which importance is measured; a few dozen rows suffice. Heads are ranked
    by ``importance``: ``norm`` (:func:`head_norms`, one pass) or ``ablation``
    (:func:`head_importance`, one pass per head). With ``refit`` the shrunk output
    projections are then re-solved against the unpruned model (:func:`refit_projections`).
    """
    if importance not in HEAD_IMPORTANCE:
        raise OptimizeError(
            f"head importance {importance!r} unknown; choose from {', '.join(HEAD_IMPORTANCE)}"
        )
    check_fraction("heads", heads)
    check_fraction("ffn", ffn)
    start = time.perf_counter()
    teacher = model.eval()
    model = copy.deepcopy(model)
    layers = encoder_layers(model)
    head_counts = [la.heads for la in layers]
    summary = PruneSummary(
        heads_before=head_counts, heads_after=list(head_counts),
        ffn_before=max(la.neurons for la in layers), ffn_after=[la.neurons for la in layers],
        params_before=_params(model), params_after=0,
    )  # fmt: skip
    if heads > 0:
        scores = HEAD_IMPORTANCE[importance](model, inputs, batch)
        keep = _heads_to_keep(scores, head_counts, heads)
        layers = [keep_heads(la, k) for la, k in zip(layers, keep, strict=True)]
    if ffn > 0:
        layers = [
            keep_neurons(la, _top(s, max(1, int(round(la.neurons * (1.0 - ffn))))))
            for la, s in zip(layers, neuron_importance(model, inputs, batch), strict=True)
        ]
    if refit and (heads > 0 or ffn > 0) and refit_projections(model, teacher, inputs, batch):
        summary.notes.append("output projections refitted by least squares")
    summary.heads_after = [la.heads for la in layers]
    summary.ffn_after = [la.neurons for la in layers]
    summary.params_after = _params(model)
    summary.seconds = time.perf_counter() - start
    return model, summary


HEAD_IMPORTANCE: dict[
    str, Callable[[torch.nn.Module, Mapping[str, np.ndarray], int], np.ndarray]
] = {
    "norm": head_norms,
    "ablation": head_importance,
}


def _top(scores: np.ndarray, n: int) -> list[int]:
    return sorted(int(i) for i in np.argsort(-scores, kind="stable")[:n])


def check_fraction(what: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise OptimizeError(f"{what} fraction to prune must be within [0, 1), got {value}")


def _hidden_states(
    layers: list[EncoderLayer], store: list[torch.Tensor]
) -> list[torch.utils.hooks.RemovableHandle]:
    def record(_m: Any, _args: Any, out: Any) -> None:
        store.append(out[0] if isinstance(out, tuple) else out)

    return [la.module.register_forward_hook(record) for la in layers]


@dataclass
class DistillRun:
    """How far :func:`distill_encoder` got: optimizer steps taken and planned, seconds."""

    steps: int
    planned: int
    steps_per_epoch: int
    seconds: float

    @property
    def epochs(self) -> float:
        return self.steps / self.steps_per_epoch


def distill_encoder(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    inputs: Mapping[str, np.ndarray],
    epochs: int = 3,
    lr: float = 1e-4,
    batch_size: int = 32,
    hidden_weight: float = 1.0,
    max_seconds: float | None = None,
    freeze_embeddings: bool = True,
    seed: int = 0,
    dropout: bool = True,
) -> tuple[torch.nn.Module, DistillRun]:
    """Train the pruned ``student`` to reproduce ``teacher`` on unlabelled ``inputs``.

    Loss: ``1 - cosine`` of the outputs plus ``hidden_weight`` times the MSE of every
    encoder layer's hidden states (pruning keeps the hidden size, so they align layer by
    layer), normalised by the teacher's hidden-state variance. Stops after ``epochs`` or
    ``max_seconds``. Token embeddings (untouched by pruning, most of the parameters) stay
    frozen unless ``freeze_embeddings`` is false. With an ``attention_mask`` input every
    batch is cut to its longest row, so short sentences train fast. Without ``dropout`` the
    student trains in eval mode (plain regression onto the teacher). Returns the student in
    eval mode and how far training got.
    """
    import torch
    import torch.nn.functional as F

    s_layers, t_layers = encoder_layers(student), encoder_layers(teacher)
    if len(s_layers) != len(t_layers):
        raise OptimizeError(
            f"student has {len(s_layers)} encoder layers, teacher {len(t_layers)}: they must match"
        )
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tensors = _as_tensors(inputs)
    n = len(tensors[0])
    mask_all = _token_mask(inputs)
    teacher.eval()
    params = [
        p
        for name, p in student.named_parameters()
        if not (freeze_embeddings and "embeddings" in name)
    ]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    per_epoch = max(1, n // batch_size)
    planned = epochs * per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, planned // 20)) * max(0.0, 1 - s / planned)
    )
    s_hidden: list[torch.Tensor] = []
    t_hidden: list[torch.Tensor] = []
    handles = _hidden_states(s_layers, s_hidden) + _hidden_states(t_layers, t_hidden)
    start = time.perf_counter()
    steps = 0
    order: list[np.ndarray] = []
    student.train(dropout)
    try:
        while steps < planned:
            if max_seconds is not None and time.perf_counter() - start > max_seconds:
                break
            if steps % per_epoch == 0:
                order = np.array_split(rng.permutation(n), per_epoch)
            rows = order[steps % per_epoch]
            width = _width(mask_all, rows)
            idx = torch.from_numpy(rows)
            batch = [t[idx][:, :width] if t.dim() == 2 and width else t[idx] for t in tensors]
            s_hidden.clear()
            t_hidden.clear()
            with torch.no_grad():
                target = teacher(*batch)
            out = student(*batch)
            loss = 1.0 - F.cosine_similarity(out.flatten(1), target.flatten(1), dim=1).mean()
            if hidden_weight > 0:
                mask = (
                    torch.from_numpy(mask_all[rows][:, :width])
                    if mask_all is not None and width
                    else None
                )
                loss = loss + hidden_weight * _hidden_loss(s_hidden, t_hidden, mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
    finally:
        for h in handles:
            h.remove()
    return student.eval(), DistillRun(steps, planned, per_epoch, time.perf_counter() - start)


def _width(mask: np.ndarray | None, rows: np.ndarray) -> int:
    """The longest real length among ``rows`` (0 without a mask: do not cut)."""
    if mask is None or mask.ndim != 2:
        return 0
    real = np.flatnonzero(mask[rows].any(axis=0))
    return int(real[-1]) + 1 if len(real) else 0


def _hidden_loss(
    student: list[torch.Tensor], teacher: list[torch.Tensor], mask: torch.Tensor | None
) -> torch.Tensor:
    """Mean over layers of the hidden-state MSE on real tokens, over the teacher's variance."""
    total = student[0].new_zeros(())
    for s, t in zip(student, teacher, strict=True):
        if mask is not None and s.dim() == 3:
            s, t = s[mask], t[mask]
        total = total + ((s - t) ** 2).mean() / t.var().clamp(min=1e-6)
    return total / max(1, len(student))


@dataclass
class LayerwiseRun:
    """How :func:`reconstruct_layers` went: per layer, steps taken and final error; seconds."""

    steps: list[int]
    errors: list[float]
    seconds: float

    def describe(self) -> str:
        errors = "/".join(f"{e:.3f}" for e in self.errors)
        return (
            f"layer-wise reconstruction {sum(self.steps)} steps, {self.seconds:.0f} s "
            f"(relative error per layer {errors})"
        )


@dataclass
class _LayerData:
    """Per batch: the first layer's input, the layer call's other arguments, the real-token
    mask; per layer and batch: the teacher's output (the target)."""

    inputs: list[torch.Tensor]
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
    masks: list[torch.Tensor | None]
    targets: list[list[torch.Tensor]]


def _length_batches(inputs: Mapping[str, np.ndarray], batch_size: int) -> list[list[torch.Tensor]]:
    """``inputs`` in batches of rows of similar length, each cut to its longest row."""
    import torch

    mask = _token_mask(inputs)
    n = len(next(iter(inputs.values())))
    lengths = mask.sum(1) if mask is not None and mask.ndim == 2 else np.zeros(n, dtype=int)
    order = np.argsort(lengths, kind="stable")
    batches = []
    for start in range(0, n, batch_size):
        rows = order[start : start + batch_size]
        width = _width(mask, rows)
        batches.append(
            [
                torch.from_numpy(
                    np.ascontiguousarray(v[rows][:, :width] if width and v.ndim == 2 else v[rows])
                )
                for v in inputs.values()
            ]
        )
    return batches


def _layer_data(
    teacher: torch.nn.Module, inputs: Mapping[str, np.ndarray], batch_size: int
) -> _LayerData:
    """One pass of ``teacher`` over ``inputs``, keeping what layer-wise training needs."""
    import torch

    layers = encoder_layers(teacher)
    names = list(inputs)
    data = _LayerData([], [], [], [[] for _ in layers])

    def first(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        data.inputs.append(args[0].detach())
        data.calls.append((args[1:], dict(kwargs)))

    def output(i: int) -> Callable[..., None]:
        def record(_m: Any, _args: Any, out: Any) -> None:
            data.targets[i].append((out[0] if isinstance(out, tuple) else out).detach())

        return record

    handles = [layers[0].module.register_forward_pre_hook(first, with_kwargs=True)]
    handles += [la.module.register_forward_hook(output(i)) for i, la in enumerate(layers)]
    teacher.eval()
    try:
        with torch.no_grad():
            for batch in _length_batches(inputs, batch_size):
                teacher(*batch)
                mask = batch[names.index("attention_mask")] if "attention_mask" in names else None
                data.masks.append(None if mask is None or mask.dim() != 2 else mask.bool())
    finally:
        for h in handles:
            h.remove()
    return data


def _call_layer(
    layer: torch.nn.Module, x: torch.Tensor, call: tuple[tuple[Any, ...], dict[str, Any]]
) -> torch.Tensor:
    out = layer(x, *call[0], **call[1])
    return out[0] if isinstance(out, tuple) else out


def _layer_error(
    y: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    if mask is not None:
        y, target = y[mask], target[mask]
    return ((y - target) ** 2).mean() / scale


def reconstruct_layers(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    inputs: Mapping[str, np.ndarray],
    epochs: int = LAYERWISE_EPOCHS,
    lr: float = 1e-3,
    batch_size: int = 32,
    max_seconds: float | None = None,
    seed: int = 0,
) -> tuple[torch.nn.Module, LayerwiseRun]:
    """Train the pruned ``student`` layer by layer to reproduce ``teacher``'s hidden states.

    The teacher runs once over ``inputs`` (rows sorted by length, so batches carry little
    padding) and its layer outputs become the targets. Then, first layer to last, one
    student layer alone (attention, FFN, LayerNorms) learns to map the student's own
    output of the layer before it to the teacher's output of this layer (MSE on real
    tokens over the teacher's variance), for ``epochs`` or its equal share of
    ``max_seconds``. A step costs one layer's forward and backward and no teacher pass, so
    many more fit in the time of end-to-end distillation, and each layer makes up for the
    errors of those before it. Layers run in eval mode (no dropout).
    """
    import torch

    s_layers, t_layers = encoder_layers(student), encoder_layers(teacher)
    if len(s_layers) != len(t_layers):
        raise OptimizeError(
            f"student has {len(s_layers)} encoder layers, teacher {len(t_layers)}: they must match"
        )
    start = time.perf_counter()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    data = _layer_data(teacher, inputs, batch_size)
    xs = data.inputs
    steps: list[int] = []
    errors: list[float] = []
    student.eval()
    for i, layer in enumerate(s_layers):
        budget = None
        if max_seconds is not None:
            budget = (max_seconds - (time.perf_counter() - start)) / (len(s_layers) - i)
        targets = data.targets[i]
        scale = _target_variance(targets, data.masks)
        steps.append(_train_layer(layer.module, xs, targets, data, scale, epochs, lr, budget, rng))
        with torch.no_grad():
            xs = [_call_layer(layer.module, x, c) for x, c in zip(xs, data.calls, strict=True)]
            errors.append(
                float(
                    sum(
                        _layer_error(y, t, m, scale) * len(y)
                        for y, t, m in zip(xs, targets, data.masks, strict=True)
                    )
                    / sum(len(y) for y in xs)
                )
            )
    return student.eval(), LayerwiseRun(steps, errors, time.perf_counter() - start)


def _target_variance(targets: list[torch.Tensor], masks: list[torch.Tensor | None]) -> float:
    import torch

    real = [t if m is None else t[m] for t, m in zip(targets, masks, strict=True)]
    return float(torch.cat([r.reshape(-1, r.shape[-1]) for r in real]).var().clamp(min=1e-6))


def _train_layer(
    layer: torch.nn.Module,
    xs: list[torch.Tensor],
    targets: list[torch.Tensor],
    data: _LayerData,
    scale: float,
    epochs: int,
    lr: float,
    seconds: float | None,
    rng: np.random.Generator,
) -> int:
    """Adam on one layer's parameters; returns the steps taken.

    The learning rate falls linearly to zero at the planned steps or at ``seconds``,
    whichever comes first, so a time-cut run still ends on small steps.
    """
    import torch

    params = [p for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    planned = max(1, epochs * len(xs))
    start = time.perf_counter()
    steps = 0
    while steps < planned:
        for b in rng.permutation(len(xs)):
            done = steps / planned
            if seconds is not None:
                done = max(done, (time.perf_counter() - start) / max(seconds, 1e-9))
            if done >= 1.0:
                return steps
            for group in opt.param_groups:
                group["lr"] = lr * (1.0 - done)
            loss = _layer_error(
                _call_layer(layer, xs[b], data.calls[b]), targets[b], data.masks[b], scale
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
    return steps
