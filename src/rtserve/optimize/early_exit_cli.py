"""``rtserve early-exit``: train an early-exit model and write it for ``backend: torch``.

Imports torch only when the command runs (``early_exit_train`` does the work).
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

MINILM_LAYERS = 6


def _exits(text: str) -> list[int]:
    """``--exits``: ascending MiniLM layers from 1 to 6, ending with 6."""
    try:
        layers = [int(v) for v in text.split(",")]
    except ValueError:
        layers = []
    if not layers or layers != sorted(set(layers)) or layers[0] < 1 or layers[-1] != MINILM_LAYERS:
        raise argparse.ArgumentTypeError(
            f"expected ascending layers from 1 to {MINILM_LAYERS} ending with {MINILM_LAYERS}, "
            f"e.g. 2,4,6; got {text!r}"
        )
    return layers


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value


def cmd_early_exit(args: argparse.Namespace) -> int:
    import torch

    from rtserve.optimize.early_exit_train import (
        exit_logits,
        sweep,
        train_digits_cnn,
        train_minilm,
        write_model,
    )

    torch.set_num_threads(args.threads)
    epochs = {"epochs": args.epochs} if args.epochs else {}
    if args.model == "minilm":
        layers = args.exits or list(range(1, MINILM_LAYERS + 1))
        trained = train_minilm(layers, seed=args.seed, **epochs)
    else:
        if args.stage1_epochs:
            epochs["stage1_epochs"] = args.stage1_epochs
        trained = train_digits_cnn(args.channels, args.blocks, seed=args.seed, **epochs)
    directory = pathlib.Path(args.out) / (args.name or args.model.replace("-", "_"))
    write_model(
        trained.net, directory, trained.build_args, trained.inputs, trained.data.classes,
        threshold=args.threshold,
    )  # fmt: skip
    logits = exit_logits(trained.net, trained.data.test, trained.names)
    thresholds = sorted({0.0, 0.5, 0.8, 0.9, 0.95, 0.99, args.threshold, 1.0})
    print(f"trained in {trained.seconds:.0f} s; test set of {len(trained.data.y_test)} rows:")
    for p in sweep(logits, trained.data.y_test, trained.net.exit_layers, thresholds):
        print(
            f"  exit_threshold {p.threshold:<5g} accuracy {p.accuracy:.4f}  "
            f"mean layers {p.mean_layers:.2f} of {trained.net.exit_layers[-1]}"
        )
    print(f"wrote {directory} (serve it with: rtserve serve --model-repository {args.out})")
    return 0


def register(subparsers: Any) -> None:
    """Add ``early-exit`` to an argparse subparsers action."""
    p = subparsers.add_parser(
        "early-exit",
        help="train an early-exit model on a shipped data set and write it for backend torch",
        description="Add exit heads to MiniLM (BBC News topics) or a digits CNN, train them "
        "with the final head as teacher, print accuracy and mean depth per threshold and "
        "write a model directory served with the request parameter exit_threshold.",
    )
    p.add_argument("model", choices=("minilm", "digits-cnn"))
    p.add_argument("--out", required=True, help="model repository to write into (required)")
    p.add_argument("--name", help="model name (default: minilm / digits_cnn)")
    p.add_argument(
        "--exits", type=_exits, help="MiniLM layers with an exit, e.g. 2,4,6 (default: every layer)"
    )
    p.add_argument(
        "--threshold", type=_probability, default=0.9, help="default exit_threshold (default: 0.9)"
    )
    p.add_argument("--channels", type=int, default=64, help="digits CNN width (default: 64)")
    p.add_argument("--blocks", type=int, default=4, help="digits CNN blocks (default: 4)")
    p.add_argument("--epochs", type=int, help="exit training epochs (default: 60)")
    p.add_argument("--stage1-epochs", type=int, help="digits CNN end-to-end epochs (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.set_defaults(func=cmd_early_exit)
