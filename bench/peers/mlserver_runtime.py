"""Peer: MLServer. A custom runtime over onnxruntime; MLServer's adaptive batching stacks requests.

The settings files are written by :mod:`bench.servers` (in-process: ``parallel_workers: 0``,
debug, gzip and metrics off, bound to 127.0.0.1).
"""

from __future__ import annotations

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

from bench.peers.common import run, session, settings


class OnnxModel(MLModel):
    async def load(self) -> bool:
        self.cfg = settings()
        self.sess = session(self.cfg)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {inp.name: NumpyCodec.decode_input(inp) for inp in payload.inputs}
        outputs = run(self.sess, feeds, self.cfg)
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output(name, array) for name, array in outputs.items()],
        )
