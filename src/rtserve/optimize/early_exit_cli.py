"""``rtserve early-exit``: train an early-exit model and write it for ``backend: torch``.

Imports torch only when the command runs (``early_exit_train`` does the work).
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any


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
    if args.model == "minilm":
        layers = [int(v) for v in args.exits.split(",")] if args.exits else [1, 2, 3, 4, 5, 6]
        trained = train_minilm(layers, seed=args.seed)
    else:
        trained = train_digits_cnn(seed=args.seed)
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
    p.add_argument("--exits", help="MiniLM layers with an exit, e.g. 2,4,6 (default: every layer)")
    p.add_argument(
        "--threshold", type=float, default=0.9, help="default exit_threshold (default: 0.9)"
    )
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.set_defaults(func=cmd_early_exit)
