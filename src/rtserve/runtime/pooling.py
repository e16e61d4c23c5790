"""An encoder's token states pooled into one vector per row: the ``embedding:`` section.

A model whose output is ``[batch, seq, hidden]`` (an ONNX or torch encoder, no pooling in
the graph) answers ``/v1/embeddings`` when its config says how::

    embedding:
      input: input_ids          # the token ids input
      mask: attention_mask      # the attention mask input ("": the model takes none)
      output: last_hidden_state # the token states ("": the model's only output)
      pooling: mean             # mean (masked) | cls (first token) | last (last real token)
      normalize: true           # L2-normalise each vector
      tokenizer: tokenizer.json # a file or a directory holding one, in the model's directory
      max_length: 512           # tokens per input at most (longer ones are refused)
      dimensions: [128, 256]    # smaller sizes a request may ask (truncated, renormalised)

The section is checked when the config is read (errors name ``embedding.<field>``); the
model's signature is checked against it when ``/v1/embeddings`` first asks for the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rtserve.config import _Fields

POOLINGS = ("mean", "cls", "last")
MAX_LENGTH = 8192


@dataclass(frozen=True, slots=True)
class EmbeddingSection:
    input: str = "input_ids"
    mask: str = "attention_mask"
    output: str = ""
    pooling: str = "mean"
    normalize: bool = True
    tokenizer: str = ""  # "": tokenizer.json in the version's directory, else the model's
    max_length: int = 512
    dimensions: tuple[int, ...] = ()


def parse_section(f: _Fields) -> EmbeddingSection:
    """The ``embedding:`` section of a model config (``f``: its fields)."""
    name = f.string("input", "input_ids")
    if not name:
        raise f.fail("input", "the name of the token ids input", name)
    tokenizer = f.string("tokenizer", "")
    path = PurePosixPath(tokenizer)
    if path.is_absolute() or ".." in path.parts or "\\" in tokenizer:
        raise f.fail(
            "tokenizer", "a path inside the model's directory (relative, without '..')", tokenizer
        )
    section = EmbeddingSection(
        input=name,
        mask=f.string("mask", "attention_mask"),
        output=f.string("output", ""),
        pooling=f.string("pooling", "mean", POOLINGS),
        normalize=f.boolean("normalize", True),
        tokenizer=tokenizer,
        max_length=f.integer("max_length", 512, minimum=1, maximum=MAX_LENGTH),
        dimensions=tuple(sorted(set(f.int_list("dimensions")))),
    )
    if section.mask == section.input:
        raise f.fail("mask", f"an input other than {section.input!r}", section.mask)
    f.check_unknown()
    return section


def pool(states: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """``[rows, seq, hidden]`` token states -> ``[rows, hidden]`` float32 vectors.
    ``mask``: ``[rows, seq]``, 1 on real tokens (right padded)."""
    states = np.asarray(states, dtype=np.float32)
    if pooling == "cls":
        return states[:, 0, :].copy()
    if pooling == "last":
        last = np.maximum(mask.sum(axis=1).astype(np.int64) - 1, 0)
        return states[np.arange(len(states)), last, :].copy()
    weights = mask.astype(np.float32)[:, :, None]
    return (states * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Each row scaled to unit L2 norm (a zero row stays zero)."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)
