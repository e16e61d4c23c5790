"""Peer: mosec. Rust HTTP front, one Python worker over IPC, dynamic batching.

orjson replaces mosec's default JSON codec (which pretty-prints); the raw V2 body is parsed in
``deserialize`` and the worker gets a list of per-request feeds.
"""

from __future__ import annotations

import sys
from typing import Any

from mosec import Server, Worker

from bench.peers.common import Feeds, decode_v2, encode_v2, run_batch, session, settings

cfg = settings()


class Infer(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.sess = session(cfg)

    def deserialize(self, data: bytes) -> Any:
        return decode_v2(data, cfg)

    def serialize(self, data: Any) -> bytes:
        return encode_v2(data, cfg)

    def forward(self, data: list[Feeds]) -> list[Feeds]:
        return run_batch(self.sess, data, cfg)


if __name__ == "__main__":
    sys.argv[1:] = ["--address", cfg.host, "--port", str(cfg.port), "--path", cfg.workdir]
    sys.argv += ["--log-level", "warning"]
    server = Server()
    server.append_worker(
        Infer,
        num=1,
        max_batch_size=cfg.max_batch_size,
        max_wait_time=max(1, round(cfg.max_wait_ms)),
        timeout=30,
    )
    server.run()
