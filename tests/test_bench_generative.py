"""bench.generative's SSE client and report against a real rtserve ``backend: llm`` server
(a tiny random-weight Llama named like the benchmark's model)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import generative
from bench.clients.sse import chat_body, closed_loop, poisson
from bench.generative_report import render
from tests.conftest import RunningServer, start_server
from tests.llm_models import build_llm

PLAN = generative.Plan(
    max_tokens=12,
    concurrency=(1, 4),
    rates=(20.0,),
    poisson_seconds=0.5,
    prefix_requests=2,
    rounds=1,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("gen-repo")
    build_llm(root, generative.MODEL)
    s = start_server(root, tmp_path_factory.mktemp("gen-server"))
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


def test_poisson_sends_every_request_and_reports_errors(server: RunningServer) -> None:
    bodies = [chat_body(generative.MODEL, generative.story(i), 4) for i in range(5)]
    bodies.append(chat_body("no-such-model", generative.story(0), 4))
    streams, wall = asyncio.run(poisson(_url(server), bodies, rate=50.0))
    row = generative.summarize(streams, wall)
    assert row["requests"] == 6 and row["errors"] == 1 and row["tokens"] == 20
    assert "HTTP 404" in row["first_error"]
    assert row["ttft_p50_ms"] <= row["ttft_p99_ms"]


def test_a_measured_round_renders_every_table(server: RunningServer, tmp_path: Path) -> None:
    url = _url(server)
    system = "You are a careful assistant. " * 8
    measured = {
        "throughput": generative.measure_throughput(url, PLAN),
        "poisson": generative.measure_poisson(url, PLAN),
        "prefix": generative.measure_prefix(url, PLAN, system),
    }
    assert measured["throughput"]["4"]["tokens"] == 8 * 12
    assert measured["prefix"]["warm"]["errors"] == 0
    result = {
        "plan": PLAN.__dict__,
        "model": "tiny",
        "machine": {"cpu": "test"},
        "versions": {},
        "command": "test",
        "rounds": [{"rtserve": measured}, {"rtserve": {"error": "RuntimeError: boom"}}],
    }
    page = render(result)
    tok_s = measured["throughput"]["4"]["tok_s"]
    assert f"| rtserve | **{measured['throughput']['1']['tok_s']:,.0f}**" in page
    assert f"({tok_s:,.0f} / -)" in page
    assert "| 20 | 240 | rtserve |" in page
    assert "round 2, rtserve: RuntimeError: boom" in page


def test_the_objective_benchmark_measures_and_renders(server: RunningServer) -> None:
    """bench.generative_slo's open loop on a real server (no objective: all admitted), and
    the page's objective section from its rounds."""
    from bench import generative_slo

    row = asyncio.run(generative_slo.poisson(_url(server), 20.0, 0.5, 4))
    assert row["requests"] == 10
    assert row["admitted"] == 10 and row["refused_429"] == 0 and row["other_errors"] == 0
    assert row["ttft_ms"] == sorted(row["ttft_ms"]) and len(row["ttft_ms"]) == 10
    assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] <= row["ttft_max_ms"]
    refused = dict(row, admitted=6, refused_429=4, ttft_p99_ms=400.0)
    refused |= {"refusal_p50_ms": 1.5, "refusal_p99_ms": 3.0}
    slo = {
        "command": "test",
        "objective_ms": 500.0,
        "max_tokens": 4,
        "rounds": [{"rtserve-objective": refused, "rtserve": row}] * 2,
    }
    page = render(
        {
            "plan": PLAN.__dict__,
            "model": "tiny",
            "machine": {},
            "versions": {},
            "command": "t",
            "rounds": [],
        },
        slo,
    )
    assert "## The first-token objective past saturation" in page
    assert "| rtserve, `ttft_p99_ms: 500` | 6 (6 / 6) | 4 (4 / 4) | 1.5 / 3.0 |" in page
    assert "within the 500 ms objective in 2 of 2 rounds" in page
