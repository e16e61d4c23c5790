"""Peer: LitServe. Batching on the LitAPI, ZeroMQ queue (``fast_queue``) as its docs advise above 100 RPS."""

from __future__ import annotations

from typing import Any

import litserve as ls

from bench.peers.common import Feeds, decode_v2, run_batch, session, settings, v2_dict

cfg = settings()


class OnnxAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.sess = session(cfg)

    # Unannotated on purpose: LitServe then hands over the parsed JSON body.
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        return decode_v2(request, cfg)

    def batch(self, inputs: list[Feeds]) -> list[Feeds]:
        return inputs

    def predict(self, x: list[Feeds]) -> list[Feeds]:
        return run_batch(self.sess, x, cfg)

    def unbatch(self, output: list[Feeds]) -> list[Feeds]:
        return output

    def encode_response(self, output: Feeds) -> dict[str, Any]:
        return v2_dict(output, cfg)


if __name__ == "__main__":
    api = OnnxAPI(
        max_batch_size=cfg.max_batch_size,
        batch_timeout=cfg.max_wait_ms / 1000.0,
        api_path="/infer",
    )
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, fast_queue=True)
    server.run(
        host=cfg.host,
        port=cfg.port,
        num_api_servers=1,
        log_level="warning",
        generate_client_file=False,
    )
