"""Peer: Ray Serve. One replica, ``@serve.batch``, the proxy bound to 127.0.0.1.

``max_ongoing_requests`` is raised above the default so a batch of 32 can form, as Ray's batching
guide advises.
"""

from __future__ import annotations

import signal

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from bench.peers.common import Feeds, decode_v2, encode_v2, run_batch, session, settings

cfg = settings()


@serve.deployment(num_replicas=1, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
class Onnx:
    def __init__(self) -> None:
        self.sess = session(cfg)

    @serve.batch(max_batch_size=cfg.max_batch_size, batch_wait_timeout_s=cfg.max_wait_ms / 1000)
    async def infer(self, requests: list[Feeds]) -> list[bytes]:
        return [encode_v2(out, cfg) for out in run_batch(self.sess, requests, cfg)]

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET":
            return Response(b'{"live":true}', media_type="application/json")
        body = await self.infer(decode_v2(await request.body(), cfg))
        return Response(body, media_type="application/json")


if __name__ == "__main__":
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=f"{cfg.workdir}/ray",
    )
    serve.start(
        http_options={"host": cfg.host, "port": cfg.port},
        logging_config={"enable_access_log": False},
    )
    serve.run(Onnx.bind(), route_prefix="/infer", name="bench")
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    signal.sigwait(stop_signals)
    serve.shutdown()
    ray.shutdown()
