"""Text-embedding peer: LitServe with batching on the LitAPI (tokenize + run per batch)."""

from __future__ import annotations

from typing import Any

import litserve as ls
import numpy as np

from bench.peers.text_common import Embedder, settings

cfg = settings()


class EmbedAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.embedder = Embedder(cfg)

    def decode_request(self, request):  # type: ignore[no-untyped-def]
        return request["text"]

    def batch(self, inputs: list[str]) -> list[str]:
        return inputs

    def predict(self, texts: list[str]) -> np.ndarray:
        return self.embedder.embed(texts)

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output: np.ndarray) -> dict[str, Any]:
        return {"embedding": output.tolist()}


if __name__ == "__main__":
    api = EmbedAPI(
        max_batch_size=cfg["max_batch_size"],
        batch_timeout=cfg["max_wait_ms"] / 1000.0,
        api_path="/embed",
    )
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, fast_queue=True)
    server.run(
        host=cfg["host"],
        port=cfg["port"],
        num_api_servers=1,
        log_level="warning",
        generate_client_file=False,
    )
