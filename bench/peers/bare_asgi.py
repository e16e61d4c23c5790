"""Limit row: the HTTP layer's ceiling.

A raw ASGI app on uvicorn (uvloop, httptools) that reads the body, parses it with orjson and
returns a fixed V2 answer. No model runs. Any server that speaks HTTP on this stack pays at
least this much per request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import uvicorn

from bench.peers.common import PeerSettings, encode_v2, settings

_HEADERS = [(b"content-type", b"application/json")]


def fixed_answer(cfg: PeerSettings) -> bytes:
    return encode_v2({t.name: np.zeros((1, *t.row_shape), dtype=t.dtype) for t in cfg.outputs}, cfg)


async def read_body(receive: Any) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def make_app(cfg: PeerSettings) -> Any:
    answer = fixed_answer(cfg)
    ok = b'{"live":true}'

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "POST":
            orjson.loads(await read_body(receive))
            body = answer
        else:
            body = ok
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": body})

    return app


def serve(app: Any, cfg: PeerSettings) -> None:
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        lifespan="off",
    )


if __name__ == "__main__":
    config = settings()
    serve(make_app(config), config)
