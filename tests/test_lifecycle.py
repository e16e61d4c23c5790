"""One shutdown for ``rtserve serve`` and ``Engine.stop``: drain, grace period, then abort.

A real server process gets SIGTERM with a generation streaming and tensor requests queued:
the queued requests are answered, the generation is cut after the grace period with an
error event saying so, and the process exits 0 soon after.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_server
from tests.models import build_slow_repository

pytest.importorskip("transformers")

GRACE_S = 0.8


def _slow_body(i: int) -> dict:
    return {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [i] * 4}]}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.llm_models import build_llm

    root = tmp_path_factory.mktemp("lifecycle")
    build_slow_repository(root, max_queue_size=16, delay_us=500_000)
    build_llm(root, "tiny", llm={"max_model_len": 1024})  # ~3 s for 1000 tokens here
    return root


async def _generation(base: str, started: asyncio.Event) -> list[dict]:
    """A streamed completion far longer than the grace period; its events as read."""
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 1000, "ignore_eos": True}
    body["stream"] = True
    events: list[dict] = []
    async with (
        httpx.AsyncClient(base_url=base, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as answer,
    ):
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append({"done": True})
                break
            events.append(json.loads(line[6:]))
            if len(events) == 5:
                started.set()
    return events


def test_sigterm_answers_queued_requests_cuts_the_generation_after_grace_and_exits_0(
    repo: Path, tmp_path: Path
) -> None:
    s = start_server(repo, tmp_path / "server", "--grace-period", str(GRACE_S))

    async def scenario() -> tuple[list[dict], list[httpx.Response], float]:
        started = asyncio.Event()
        generation = asyncio.create_task(_generation(s.base, started))
        await asyncio.wait_for(started.wait(), 30)
        async with httpx.AsyncClient(base_url=s.base, timeout=30) as client:
            queued = [
                asyncio.create_task(client.post("/v2/models/slow/infer", json=_slow_body(i)))
                for i in range(3)
            ]
            await asyncio.sleep(0.15)  # admitted, waiting in the batch window
            s.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            answers = list(await asyncio.gather(*queued))
        return await generation, answers, signalled

    try:
        events, answers, signalled = asyncio.run(scenario())
        assert [r.status_code for r in answers] == [200, 200, 200]
        assert [r.json()["outputs"][0]["data"][0] for r in answers] == [0.0, 3.0, 6.0]
        # The generation ran past the grace period, then ended with an error event that
        # says why, and the stream closed properly.
        assert events[-1] == {"done": True}, events[-3:]
        error = events[-2].get("error")
        assert error is not None, events[-3:]
        assert "generation cut after the 0.8 s grace period" in error["message"], error
        assert error["type"] == "service_unavailable_error", error
        tokens = [e for e in events[:-2] if "choices" in e]
        assert 5 <= len(tokens) < 1000
        assert all(c["finish_reason"] is None for e in tokens for c in e["choices"])
        assert s.proc.wait(GRACE_S + 10) == 0
        took = time.monotonic() - signalled
        assert took < GRACE_S + 5, took
        log = s.log_path.read_text()
        assert "grace period of" in log and "stopped" in log, log[-2000:]
    finally:
        s.stop()


def test_sigterm_when_idle_exits_0_at_once(tmp_path: Path) -> None:
    """Nothing in flight: the drain ends at once (not after the grace period)."""
    repo = build_slow_repository(tmp_path / "repo", max_queue_size=16, delay_us=1000)
    s = start_server(repo, tmp_path / "server", "--grace-period", "30")
    try:
        assert httpx.post(f"{s.base}/v2/models/slow/infer", json=_slow_body(1)).status_code == 200
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(20) == 0
        assert time.monotonic() - start < 10
        assert "grace period of" not in s.log_path.read_text()
    finally:
        s.stop()
