"""What the text-embedding peers share: sentences -> token ids -> MiniLM INT8 -> embeddings.

The same tokenizer.json and ONNX file as rtserve's ``text-embedding`` example; imported in
the peers' own virtual environments (tokenizers, onnxruntime, numpy). Settings arrive as JSON
in ``BENCH_TEXT``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

MAX_TOKENS = 256


def settings() -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads(os.environ["BENCH_TEXT"])
    return cfg


class Embedder:
    """Tokenize a list of sentences, pad to the longest, run the model once."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.tokenizer = Tokenizer.from_file(cfg["tokenizer_path"])
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(MAX_TOKENS)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = cfg["intra_op_threads"]
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(
            cfg["model_path"], opts, providers=["CPUExecutionProvider"]
        )

    def embed(self, texts: list[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(texts)
        width = max(len(e.ids) for e in encodings)
        ids = np.zeros((len(texts), width), dtype=np.int64)
        mask = np.zeros((len(texts), width), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            n = len(encoding.ids)
            ids[row, :n] = encoding.ids
            mask[row, :n] = 1
        out: np.ndarray = self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        return out
