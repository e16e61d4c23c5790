"""The servers under test, one small app module per peer.

Peer apps run inside their own virtual environments, so they import only :mod:`bench.peers.common`
(numpy, onnxruntime, orjson) from this package; the launch recipes live in :mod:`bench.servers`.
"""
