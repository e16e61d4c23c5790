"""Label step of the ``image-classifier`` example: 1000 ImageNet logits -> top-5 names.

``imagenet_classes.txt`` (next to this file) holds the 1000 class names in the model's
index order; the scores are softmax probabilities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

TOP = 5


class Model:
    def load(self, context: Any) -> None:
        names = (Path(context.version_dir) / "imagenet_classes.txt").read_text().splitlines()
        if len(names) != 1000:
            raise ValueError(f"imagenet_classes.txt: expected 1000 names, found {len(names)}")
        self.names = np.array([n.encode() for n in names], dtype=object)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = inputs["logits"].astype(np.float32)
        top = np.argsort(-logits, axis=1)[:, :TOP]
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities = shifted / shifted.sum(axis=1, keepdims=True)
        return {
            "labels": self.names[top],
            "scores": np.take_along_axis(probabilities, top, axis=1).astype(np.float32),
        }
