"""bench.generative's SSE client and report against a real rtserve ``backend: llm`` server
(a tiny random-weight Llama named like the benchmark's model)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench import generative
from bench.clients.sse import chat_body, closed_loop
from bench.generative_report import render
from tests.conftest import RunningServer, start_server
from tests.llm_models import build_llm

PLAN = generative.Plan(max_tokens=12, rounds=1, concurrency={"stories": (1, 4)})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("gen-repo")
    build_llm(root, generative.MODEL)
    s = start_server(root, tmp_path_factory.mktemp("gen-server"), timeout=240.0)
    yield s
    s.stop()


def _url(server: RunningServer) -> str:
    return f"{server.base}/v1/chat/completions"


def test_each_streamed_token_is_stamped_in_order(server: RunningServer) -> None:
    bodies = [chat_body(generative.MODEL, generative.story(i), 12) for i in range(6)]
    streams, wall = asyncio.run(closed_loop(_url(server), bodies, 3))
    assert len(streams) == 6 and wall > 0
    for s in streams:
        assert s.error is None
        assert s.completion_tokens == 12 and s.finish_reason == "length"  # ignore_eos honoured
        assert 1 <= len(s.chunks) <= 12 and s.text
        assert s.sent < s.chunks[0] and s.chunks == sorted(s.chunks)
        assert s.ttft is not None and s.ttft > 0 and len(s.itls) == len(s.chunks) - 1


def test_every_request_is_sent_and_errors_are_reported(server: RunningServer) -> None:
    bodies = [chat_body(generative.MODEL, generative.story(i), 4) for i in range(5)]
    bodies.append(chat_body("no-such-model", generative.story(0), 4))
    streams, wall = asyncio.run(closed_loop(_url(server), bodies, 2))
    row = generative.summarize(streams, wall)
    assert row["requests"] == 6 and row["errors"] == 1 and row["tokens"] == 20
    assert "HTTP 404" in row["first_error"]
    assert row["ttft_p50_ms"] <= row["ttft_p99_ms"]


def test_a_measured_round_renders_every_table(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _url(server)
    # the tiny model (a small vocabulary, 1,024 positions) gets a short document
    monkeypatch.setattr(generative, "document", lambda: "The cat sat on the mat by the door. " * 6)
    measured = {w: generative.measure_workload(url, w, PLAN) for w in ("stories", "summarize")}
    assert measured["stories"]["4"]["tokens"] == 4 * PLAN.requests_per_stream * 12
    assert measured["summarize"]["1"]["errors"] == 0
    result = {
        "plan": PLAN.__dict__,
        "model": "tiny",
        "machine": {"cpu": "test"},
        "command": "test",
        "servers": ["rtserve-fp32", "llamacpp-q8_0"],
        "rounds": [
            {"rtserve-fp32": measured, "llamacpp-q8_0": {"error": "RuntimeError: boom"}},
            {"rtserve-fp32": measured},
        ],
    }
    page = render(result)
    tok_s = measured["stories"]["4"]["tok_s"]
    assert f"| rtserve-fp32 | **{measured['stories']['1']['tok_s']:,.0f}**" in page
    assert f"({tok_s:,.0f} / {tok_s:,.0f})" in page
    assert "## summarize" in page and "llamacpp-q8_0 |" not in page
    assert "round 1, llamacpp-q8_0: RuntimeError: boom" in page
    # a ratio needs both servers in a round: none here, then one round with a reference
    assert "## Ratios" not in page
    result["rounds"][1]["rtserve-fp32-lookup"] = {"summarize": {"1": {"tok_s": 3.0}}}
    result["rounds"][1]["rtserve-fp32"] = {"summarize": {"1": {"tok_s": 2.0}}}
    assert "summarize at 1 stream(s): **1.50x** (rounds: - / 1.50)" in render(result)


def test_every_server_recipe_is_named_once_and_unknown_ones_are_refused() -> None:
    assert {"rtserve-int4", "vllm-bfloat16", "llamacpp-q4_k_m"} <= set(generative.SERVERS)
    with pytest.raises(SystemExit):
        generative.main(["--servers", "rtserve-fp32,no-such-server"])


def test_the_suite_table_runs_each_suite_through_its_module() -> None:
    import importlib

    from bench.__main__ import SUITES

    for suite in SUITES.values():
        assert callable(importlib.import_module(suite.module).main)
