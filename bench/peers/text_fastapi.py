"""Text-embedding peer: the tutorial pattern. FastAPI, a pydantic body, a sync endpoint that
tokenizes and runs the model for each request (no batching)."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from bench.peers.text_common import Embedder, settings

cfg = settings()
embedder = Embedder(cfg)
app = FastAPI()


class EmbedRequest(BaseModel):
    text: str


@app.get("/health")
def health() -> dict[str, bool]:
    return {"live": True}


@app.post("/embed")
def embed(request: EmbedRequest) -> dict[str, list[float]]:
    return {"embedding": embedder.embed([request.text])[0].tolist()}


if __name__ == "__main__":
    uvicorn.run(app, host=cfg["host"], port=cfg["port"], access_log=False, log_level="warning")
