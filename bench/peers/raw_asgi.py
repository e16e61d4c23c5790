"""Reference: a hand-rolled ASGI app that runs the model once per request, no batching.

Same stack and parser as :mod:`bench.peers.bare_asgi`; the model runs inline on the event loop,
which is the fastest unbatched shape for a model that answers in microseconds.
"""

from __future__ import annotations

from typing import Any

from bench.peers.bare_asgi import read_body, serve
from bench.peers.common import PeerSettings, decode_v2, encode_v2, run, session, settings

_HEADERS = [(b"content-type", b"application/json")]


def make_app(cfg: PeerSettings) -> Any:
    sess = session(cfg)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "POST":
            feeds = decode_v2(await read_body(receive), cfg)
            body = encode_v2(run(sess, feeds, cfg), cfg)
        else:
            body = b'{"live":true}'
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": body})

    return app


if __name__ == "__main__":
    config = settings()
    serve(make_app(config), config)
