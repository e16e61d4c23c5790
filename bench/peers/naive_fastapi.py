"""Peer: the tutorial pattern. FastAPI, a pydantic request model, a sync endpoint, one run per request.

Started the way FastAPI's docs show (``uvicorn`` from ``uvicorn[standard]``, so uvloop and
httptools), access log off.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from bench.peers.common import run, session, settings, v2_dict

cfg = settings()
sess = session(cfg)
specs = {t.name: t for t in cfg.inputs}
app = FastAPI()


class Tensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[float]


class InferRequest(BaseModel):
    inputs: list[Tensor]


@app.get("/health")
def health() -> dict[str, bool]:
    return {"live": True}


@app.post("/infer")
def infer(request: InferRequest) -> dict[str, Any]:
    feeds = {
        t.name: np.asarray(t.data, dtype=specs[t.name].dtype).reshape(t.shape)
        for t in request.inputs
    }
    return v2_dict(run(sess, feeds, cfg), cfg)


if __name__ == "__main__":
    uvicorn.run(app, host=cfg.host, port=cfg.port, access_log=False, log_level="warning")
