"""Tokenizer step of the ``text-embedding`` example: UTF-8 sentences -> MiniLM token ids.

Uses the ``tokenizers`` library with the all-MiniLM-L6-v2 ``tokenizer.json`` copied next to
this file. Rows are padded to the next bucket length (16, 32, 64, 128, 256 tokens) so the
MiniLM step receives few distinct shapes and batches rows from many requests together;
the padding is masked out by the model's mean pooling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

BUCKETS = (16, 32, 64, 128, 256)


class Model:
    def load(self, context: Any) -> None:
        self.tokenizer = Tokenizer.from_file(str(Path(context.version_dir) / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(BUCKETS[-1])

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [t.decode("utf-8", errors="replace") for t in inputs["text"].reshape(-1)]
        encodings = self.tokenizer.encode_batch(texts)
        longest = max(len(e.ids) for e in encodings)
        width = next(b for b in BUCKETS if b >= longest)
        ids = np.zeros((len(texts), width), dtype=np.int64)  # 0 is [PAD]
        mask = np.zeros((len(texts), width), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            n = len(encoding.ids)
            ids[row, :n] = encoding.ids
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask}
