"""``rtserve early-exit``: train an early-exit model and write it for ``backend: torch``.

Imports torch only when the command runs (``early_exit_train`` does the work).
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any

from rtserve.optimize.errors import OptimizeError

MINILM_LAYERS = 6
DIGITS_DEFAULTS = {"channels": 64, "blocks": 4, "stage1_epochs": 8}
MAX_SEED = 2**32 - 1  # scikit-learn's random_state (the train/test split) takes no more


def _exits(text: str) -> list[int]:
    """``--exits``: comma-separated layers (the model's depth is checked in :func:`_check`)."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layers, e.g. 2,4,6; got {text!r}"
        ) from None


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value


def _name(text: str | None, default: str) -> str:
    """``--name``: one plain path component (the folder under ``--out``)."""
    if text is None:
        return default
    if text in ("", ".", "..") or any(c in text for c in "/\\\0"):
        raise OptimizeError(
            f"--name: expected a plain folder name (no '/', '\\', not '.' or '..'), got {text!r}"
        )
    return text


def _folder(out: str, directory: pathlib.Path) -> None:
    """``--out``: a folder, or a path where one can be made, and ``directory`` inside it too."""
    if not out:
        raise OptimizeError("--out: expected a folder path, got ''")
    root = pathlib.Path(out)
    chain = [("--out", path) for path in (*reversed(root.parents), root)]
    chain += [("--name", directory), ("--name", directory / "1")]
    for option, path in chain:
        if path.exists() and not path.is_dir():
            raise OptimizeError(f"{option}: expected a folder, but {path} is a file")
        if not path.exists():
            parent = path.parent
            if not os.access(parent, os.W_OK | os.X_OK):
                raise OptimizeError(f"{option}: cannot create {path}: {parent} is not writable")
            return


def _check(args: argparse.Namespace) -> pathlib.Path:
    """Every value, before anything is trained; the model directory to write."""
    digits = args.model == "digits-cnn"
    if not digits:
        for option in ("channels", "blocks", "stage1_epochs"):
            if getattr(args, option) is not None:
                flag = "--" + option.replace("_", "-")
                raise OptimizeError(f"{flag}: expected only with digits-cnn, not with {args.model}")
    from rtserve.optimize.args import at_least

    at_least(args, {"channels": 1, "blocks": 1, "epochs": 1, "stage1_epochs": 1, "threads": 1})
    if not 0 <= args.seed <= MAX_SEED:
        raise OptimizeError(f"--seed: expected an integer from 0 to {MAX_SEED}, got {args.seed}")
    if args.exits is not None:
        depth = MINILM_LAYERS
        if digits:
            depth = DIGITS_DEFAULTS["blocks"] if args.blocks is None else args.blocks
        layers = args.exits
        if layers != sorted(set(layers)) or layers[0] < 1 or layers[-1] != depth:
            unit = "blocks" if digits else "layers"
            example = ",".join(str(d) for d in sorted({max(1, depth // 2), depth}))
            raise OptimizeError(
                f"--exits: expected ascending {unit} from 1 to {depth} ending with {depth} "
                f"(the last of {args.model}), e.g. {example}; got {','.join(map(str, layers))}"
            )
    name = _name(args.name, args.model.replace("-", "_"))
    directory = pathlib.Path(args.out) / name
    _folder(args.out, directory)
    return directory


def cmd_early_exit(args: argparse.Namespace) -> int:
    directory = _check(args)

    import torch

    from rtserve.optimize.early_exit_train import (
        bbc_news_topics,
        exit_logits,
        sweep,
        train_digits_cnn,
        train_minilm,
        write_model,
    )

    torch.set_num_threads(args.threads)
    epochs = {"epochs": args.epochs} if args.epochs is not None else {}
    if args.model == "minilm":
        bbc_news_topics()  # the data set is there, before the encoder loads
        layers = args.exits or list(range(1, MINILM_LAYERS + 1))
        trained = train_minilm(layers, seed=args.seed, **epochs)
    else:
        trained = train_digits_cnn(
            DIGITS_DEFAULTS["channels"] if args.channels is None else args.channels,
            DIGITS_DEFAULTS["blocks"] if args.blocks is None else args.blocks,
            seed=args.seed,
            stage1_epochs=(
                DIGITS_DEFAULTS["stage1_epochs"] if args.stage1_epochs is None
                else args.stage1_epochs
            ),
            exit_layers=args.exits,
            **epochs,
        )  # fmt: skip
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
    from rtserve.optimize.args import guard

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
        "--exits",
        type=_exits,
        help="MiniLM layers / digits CNN blocks with an exit, ascending and ending with the "
        "last, e.g. 2,4,6 (default: every one)",
    )
    p.add_argument(
        "--threshold", type=_probability, default=0.9, help="default exit_threshold (default: 0.9)"
    )
    p.add_argument("--channels", type=int, help="digits CNN width (default: 64)")
    p.add_argument("--blocks", type=int, help="digits CNN blocks (default: 4)")
    p.add_argument("--epochs", type=int, help="exit training epochs (default: 60)")
    p.add_argument("--stage1-epochs", type=int, help="digits CNN end-to-end epochs (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.set_defaults(func=guard(cmd_early_exit))
