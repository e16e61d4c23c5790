"""Text-embedding peer: BentoML, a batchable API over a list of sentences."""

from __future__ import annotations

import bentoml
import numpy as np

from bench.peers.text_common import Embedder, settings

cfg = settings()


@bentoml.service(workers=1, logging={"access": {"enabled": False}}, traffic={"timeout": 60})
class TextEmbedding:
    def __init__(self) -> None:
        self.embedder = Embedder(cfg)

    @bentoml.api(
        batchable=True,
        max_batch_size=cfg["max_batch_size"],
        max_latency_ms=10_000,
        route="/embed",
    )
    def embed(self, texts: list[str]) -> np.ndarray:
        return self.embedder.embed(texts)
