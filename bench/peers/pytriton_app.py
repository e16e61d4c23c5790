"""Peer: NVIDIA Triton (bundled by PyTriton) with dynamic batching; the model runs in a Python callable.

Triton speaks V2 over HTTP and gRPC, so perf_analyzer measures it too. The security config opens
the model-config endpoints perf_analyzer needs.
"""

from __future__ import annotations

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

from bench.peers.common import run, session, settings

cfg = settings()
sess = session(cfg)


@batch
def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
    return run(sess, inputs, cfg)


if __name__ == "__main__":
    config = TritonConfig(
        http_address=cfg.host,
        http_port=cfg.port,
        grpc_address=cfg.host,
        grpc_port=cfg.grpc_port,
        metrics_address=cfg.host,
        metrics_port=cfg.metrics_port,
        allow_metrics=False,
        log_verbose=0,
    )
    with Triton(
        config=config,
        workspace=f"{cfg.workdir}/pytriton",
        security_config=TritonSecurityConfig(restricted_endpoints=[]),
    ) as triton:
        triton.bind(
            model_name=cfg.model_name,
            infer_func=infer,
            inputs=[Tensor(name=t.name, dtype=t.dtype, shape=t.row_shape) for t in cfg.inputs],
            outputs=[Tensor(name=t.name, dtype=t.dtype, shape=t.row_shape) for t in cfg.outputs],
            config=ModelConfig(
                max_batch_size=cfg.max_batch_size,
                batcher=DynamicBatcher(
                    max_queue_delay_microseconds=round(cfg.max_wait_ms * 1000),
                    preferred_batch_size=[cfg.max_batch_size],
                ),
            ),
            strict=False,
        )
        triton.serve()
