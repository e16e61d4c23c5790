"""OpenAI chat completions over server-sent events, each token chunk timestamped (aiohttp).

Drives any OpenAI-compatible server (rtserve's ``backend: llm``, vLLM): closed-loop streams at
a fixed concurrency for tokens/s, time to first token (TTFT) and inter-token latency (ITL).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

Messages = list[dict[str, str]]


@dataclass
class Stream:
    """One streamed answer: when it was sent, when each content chunk arrived, what ended it."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


def chat_body(
    model: str, messages: Messages, max_tokens: int, ignore_eos: bool = True
) -> dict[str, Any]:
    """A greedy streaming chat request that asks for the usage chunk at the end."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _apply(event: dict[str, Any], stream: Stream, now: float) -> None:
    usage = event.get("usage")
    if usage:
        stream.completion_tokens = usage.get("completion_tokens")
    for choice in event.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            stream.chunks.append(now)
            stream.text += content
        if choice.get("finish_reason"):
            stream.finish_reason = choice["finish_reason"]


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Stream:
    """POST ``body`` and read the SSE answer, stamping each chunk that carries content. A
    pooled connection the server had closed (the request never reached it) is retried once
    on a new one: a server that closes after each stream is not charged an error."""
    stream = await _stream_chat(session, url, body)
    if stream.error and stream.error.startswith(_STALE) and not stream.chunks:
        stream = await _stream_chat(session, url, body)
    return stream


_STALE = ("ClientOSError", "ServerDisconnectedError")


async def _stream_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Stream:
    stream = Stream(sent=time.perf_counter())
    try:
        async with session.post(url, data=orjson.dumps(body)) as resp:
            if resp.status != 200:
                stream.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return stream
            async for raw in resp.content:
                now = time.perf_counter()
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                _apply(orjson.loads(data), stream, now)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    return stream


def _session(limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        # a new connection per request: servers differ in keeping one after a stream
        connector=aiohttp.TCPConnector(limit=limit + 8, force_close=True),
        timeout=aiohttp.ClientTimeout(total=600),
        headers={"Content-Type": "application/json"},
    )


async def closed_loop(
    url: str, bodies: Sequence[dict[str, Any]], concurrency: int, max_seconds: float = 1e9
) -> tuple[list[Stream], float]:
    """``concurrency`` streams in flight until every body is answered, no new one sent after
    ``max_seconds``; (streams, wall s)."""
    queue = list(reversed(bodies))
    streams: list[Stream] = []
    async with _session(concurrency) as session:
        start = time.perf_counter()

        async def worker() -> None:
            while queue and time.perf_counter() - start < max_seconds:
                streams.append(await stream_chat(session, url, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return streams, time.perf_counter() - start
