"""Serving an early-exit network (``torch.early_exit`` in a torch model's config).

The module offers ``exit_layers`` (the backbone depth at each exit), ``begin(*inputs)`` ->
state, ``advance(i, state)`` -> state and ``head(i, state)`` -> logits (see
``rtserve.optimize.early_exit.ExitNet``). A row answers at the first exit whose top-class
softmax probability is strictly greater than its ``exit_threshold``: 0 answers every row at
the first exit (a top probability is at least 1/classes), 1 at the last (none exceeds 1).

Two ways to run a batch, with the same answers (each row: its first confident exit):
- ``rows``: rows that answered leave the batch; later segments run on the rest only.
- ``all``: the whole batch runs on until every row has answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rtserve.errors import ConfigError
from rtserve.runtime.parameters import RowParameter

THRESHOLD = "exit_threshold"
MODES = ("rows", "all")
_METHODS = ("begin", "advance", "head", "exit_layers")


def threshold_parameter(default: float) -> RowParameter:
    return RowParameter(
        THRESHOLD,
        default,
        meaning="the top-class probability an exit must exceed to answer",
    )


class ExitRunner:
    """Runs batches through an early-exit module and counts answers per exit."""

    def __init__(
        self,
        module: Any,
        logits: str,
        exit_output: str,
        mode: str,
        default: float,
        instances: int,
        where: str,
    ) -> None:
        missing = [m for m in _METHODS if not hasattr(module, m)]
        if missing:
            raise ConfigError(
                f"{where}: torch.early_exit: the model has no {', '.join(missing)} "
                "(an early-exit model: rtserve.optimize.early_exit.ExitNet)"
            )
        self.depths: tuple[int, ...] = tuple(int(d) for d in module.exit_layers)
        self.logits = logits
        self.exit_output = exit_output
        self.mode = mode
        self.default = default
        self._counts = [[0] * len(self.depths) for _ in range(instances)]
        self._depth_table = torch.tensor(self.depths, dtype=torch.int32)

    def reset(self) -> None:
        """Forget the rows counted so far (warmup's)."""
        self._counts = [[0] * len(self.depths) for _ in self._counts]

    def counts(self) -> dict[int, int]:
        """Rows answered so far at each exit, by its backbone depth (every instance)."""
        return {d: sum(c[i] for c in self._counts) for i, d in enumerate(self.depths)}

    def run(
        self,
        module: Any,
        args: Sequence[torch.Tensor],
        thresholds: torch.Tensor | None,
        instance: int,
    ) -> dict[str, torch.Tensor]:
        rows = args[0].shape[0]
        if thresholds is None:
            thresholds = torch.full((rows,), self.default)
        thresholds = thresholds.to(args[0].device)
        logits, exit_at = self._answer(module, args, thresholds, self.mode == "rows")
        counts = self._counts[instance]
        for i, n in enumerate(torch.bincount(exit_at, minlength=len(self.depths)).tolist()):
            counts[i] += n
        return {
            self.logits: logits,
            self.exit_output: self._depth_table.to(exit_at.device)[exit_at],
        }

    def _answer(
        self,
        module: Any,
        args: Sequence[torch.Tensor],
        thresholds: torch.Tensor,
        leave: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's logits at its first confident exit, and that exit's index. ``leave``:
        rows that answered leave the batch; else it runs on until every row has answered."""
        rows = args[0].shape[0]
        last = len(self.depths) - 1
        device = args[0].device
        index = torch.arange(rows, device=device)  # the batch's rows, by their place in args
        pending = torch.ones(rows, dtype=torch.bool, device=device)  # not answered yet
        exit_at = torch.full((rows,), last, dtype=torch.long, device=device)
        out: torch.Tensor | None = None
        left = rows
        state = module.begin(*args)
        for i in range(last + 1):
            state = module.advance(i, state)
            logits = module.head(i, state)
            if out is None:
                out = logits.new_empty((rows, *logits.shape[1:]))
            done = pending if i == last else _confident(logits, thresholds) & pending
            answered = left if i == last else int(done.sum())
            if answered == 0:
                continue
            out[index[done]] = logits[done]
            exit_at[index[done]] = i
            left -= answered
            if left == 0:
                break
            if leave:
                keep = ~done
                index, thresholds, pending = index[keep], thresholds[keep], pending[keep]
                state = tuple(s[keep] for s in state)
            else:
                pending &= ~done
        assert out is not None
        return out, exit_at


def _confident(logits: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    top = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
    return (top > thresholds) | (thresholds <= 0)  # (0: answer here, even a NaN row)
