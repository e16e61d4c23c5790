"""Peer: BentoML. A batchable API; BentoML's adaptive batcher stacks the ``inputs`` lists.

The body's ``inputs`` list has one entry per tensor, so a request is ``len(inputs)`` items of
BentoML's batch; ``max_batch_size`` is scaled by that count so that a batch holds 32 requests.
The answer is the list of per-tensor outputs: the model's outputs on the request's first entry.
"""

from __future__ import annotations

from typing import Any

import bentoml
import numpy as np

from bench.peers.common import run, session, settings

cfg = settings()
_PER_REQUEST = len(cfg.inputs)


@bentoml.service(workers=1, logging={"access": {"enabled": False}}, traffic={"timeout": 60})
class Onnx:
    def __init__(self) -> None:
        self.sess = session(cfg)
        self.specs = {t.name: t for t in cfg.inputs}

    @bentoml.api(
        batchable=True,
        max_batch_size=cfg.max_batch_size * _PER_REQUEST,
        max_latency_ms=10_000,
        route="/infer",
    )
    def infer(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
        columns: dict[str, list[np.ndarray]] = {name: [] for name in self.specs}
        for item in inputs:
            spec = self.specs[item["name"]]
            columns[spec.name].append(
                np.asarray(item["data"], dtype=spec.dtype).reshape(item["shape"])
            )
        stacked = {name: np.concatenate(parts) for name, parts in columns.items()}
        outputs = run(self.sess, stacked, cfg)
        answers: list[dict[str, Any] | None] = []
        for row in range(len(inputs) // _PER_REQUEST):
            answers.append(
                {
                    "outputs": [
                        {"name": n, "shape": [1, *a.shape[1:]], "data": a[row].tolist()}
                        for n, a in outputs.items()
                    ]
                }
            )
            answers.extend([None] * (_PER_REQUEST - 1))
        return answers
