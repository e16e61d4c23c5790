"""The servers under test: one small app module per serving peer, and one start recipe
module per generative peer (``llamacpp``, ``vllm``).

Peer apps run inside their own virtual environments, so they import only :mod:`bench.peers.common`
(numpy, onnxruntime, orjson) from this package; their launch recipes live in :mod:`bench.servers`.
"""
