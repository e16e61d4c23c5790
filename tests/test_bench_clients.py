"""The benchmark suite's clients: wrk script and output, perf_analyzer CSV, open-loop arrivals."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bench.clients import openloop, perf_analyzer, wrk
from tests.conftest import RunningServer


def _has_cc() -> bool:
    return shutil.which("cc") is not None


# Captured from `wrk -t1 -c2 -d1s --latency -s post.lua` on this machine (the done hook's line).
WRK_OUTPUT = """\
Running 1s test @ http://127.0.0.1:18555/
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.02ms    1.09ms   7.74ms   83.41%
    Req/Sec     2.29k   212.36     2.65k    70.00%
  Latency Distribution
     50%  486.00us
     75%    1.36ms
     90%    2.86ms
     99%    4.32ms
  2283 requests in 1.00s, 1.21MB read
  Non-2xx or 3xx responses: 2283
Requests/sec:   2277.88
Transfer/sec:      1.21MB
BENCH_JSON {"requests":2283,"duration_us":1002247,"connect":0,"read":0,"write":0,"status":2283,"timeout":0,"p50_us":486,"p90_us":2857,"p99_us":4321}
"""

# Captured from perf_analyzer 2.51 `-f` against Triton (closed loop, then Poisson open loop).
PA_CLOSED_CSV = """\
Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency
8,663.348,47,1778,3893,54,5938,257,0,7534,17662,32132,103088
"""
PA_OPEN_CSV = """\
Request Rate,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency
500,481.918,2,838,2031,171,4268,427,1,4410,10915,16422,41312
"""
PA_OPEN_STDOUT = """\
Request Rate: 500 inference requests per seconds
  Client:
    Request count: 3476
    Avg send request rate: 482.36 infer/sec
    [WARNING] Perf Analyzer was not able to keep up with the desired request rate. 90.88% of the requests were delayed.
    Throughput: 481.92 infer/sec
"""


def test_wrk_parse_prefers_done_hook_and_counts_non_2xx_as_errors() -> None:
    parsed = wrk.parse(WRK_OUTPUT)
    assert parsed["requests"] == 2283
    assert parsed["rps"] == pytest.approx(2283 / 1.002247)
    assert parsed["p50_ms"] == pytest.approx(0.486)
    assert parsed["p90_ms"] == pytest.approx(2.857)
    assert parsed["p99_ms"] == pytest.approx(4.321)
    assert parsed["errors"] == 2283


def test_wrk_parse_rejects_output_without_throughput() -> None:
    with pytest.raises(ValueError):
        wrk.parse("unable to connect to 127.0.0.1:1 Connection refused")


def test_lua_script_embeds_body_even_when_it_contains_closing_brackets() -> None:
    body = b'{"x":[[1,2]],"y":"]=]"}'
    script = wrk.lua_script(body)
    assert 'wrk.method = "POST"' in script
    assert "[==[" + body.decode() + "]==]" in script
    assert "BENCH_JSON" in script


def test_perf_analyzer_csv_gives_rps_and_percentiles_in_ms() -> None:
    closed = perf_analyzer.parse_csv(PA_CLOSED_CSV)
    assert closed == {"rps": 663.348, "p50_ms": 7.534, "p90_ms": 17.662, "p99_ms": 103.088}
    opened = perf_analyzer.parse_csv(PA_OPEN_CSV)
    assert opened["rps"] == pytest.approx(481.918)
    assert opened["p99_ms"] == pytest.approx(41.312)


def test_perf_analyzer_empty_csv_is_an_error() -> None:
    with pytest.raises(ValueError):
        perf_analyzer.parse_csv(PA_CLOSED_CSV.splitlines()[0] + "\n")


def test_perf_analyzer_stdout_gives_count_and_lateness() -> None:
    found = perf_analyzer.parse_stdout(PA_OPEN_STDOUT)
    assert found == {"requests": 3476, "delayed_pct": 90.88}


def test_perf_analyzer_error_line_picks_the_failure() -> None:
    out = "*** Measurement Settings ***\nerror: failed to get model config: Method not found!\n"
    assert perf_analyzer.error_line(out) == "error: failed to get model config: Method not found!"


def _pa(client: str, **load: float) -> list[str]:
    return perf_analyzer.command(
        client, "mlp", "127.0.0.1:9", Path("data.json"), Path("out.csv"), 1000, **load
    )  # type: ignore[arg-type]


def test_perf_analyzer_command_open_loop_is_poisson_and_async() -> None:
    cmd = _pa("pa-grpc", rate=250)
    assert cmd[cmd.index("-i") + 1] == "grpc"
    assert cmd[cmd.index("--request-rate-range") + 1] == "250"
    assert "poisson" in cmd and "--async" in cmd
    assert "--concurrency-range" not in cmd


def test_perf_analyzer_command_json_closed_loop() -> None:
    cmd = _pa("pa-http-json", concurrency=8)
    assert cmd[cmd.index("--input-tensor-format") + 1] == "json"
    assert cmd[cmd.index("--concurrency-range") + 1] == "8"
    assert "--request-rate-range" not in cmd


def test_open_loop_arrivals_are_poisson_at_the_asked_rate() -> None:
    times = openloop.arrivals(2000.0, 5.0, seed=3)
    assert np.all(np.diff(times) > 0)
    assert times[-1] < 5.0
    assert len(times) == pytest.approx(10_000, rel=0.05)
    gaps = np.diff(times)
    # exponential gaps: mean equals standard deviation
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.1)


# ---------------------------------------------------------------- the C open-loop client
def _c_client_run(
    server: RunningServer, tmp_path: Path, request: bytes, rate: float, seconds: float
) -> dict:
    from bench.clients import openloop_c

    req = tmp_path / "request.http"
    req.write_bytes(request)
    out = tmp_path / "result.json"
    cmd = openloop_c.command("127.0.0.1", server.http_port, req, rate, seconds, 7, 16, 5.0, out)
    subprocess.run(cmd, check=True, timeout=seconds + 30)
    return json.loads(out.read_text())


@pytest.mark.skipif(not _has_cc(), reason="no C compiler")
def test_the_c_open_loop_client_sends_poisson_arrivals_and_times_each_answer(
    server: RunningServer, tmp_path: Path
) -> None:
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    ).encode()
    ok = openloop.post_request("127.0.0.1", server.http_port, "/v2/models/scale/infer", body)
    r = _c_client_run(server, tmp_path, ok, 400.0, 1.5)
    # Poisson: ~600 arrivals in 1.5 s (5 sigma of sqrt(600) ~ 122)
    assert abs(r["scheduled"] - 600) < 125
    assert r["codes"] == {"200": r["scheduled"]}
    assert r["unfinished"] == 0 and r["errors"] == 0
    lat = np.asarray(r["latency_ms"])
    assert lat.size == r["scheduled"]
    assert (lat > 0).all() and np.median(lat) < 100
    assert 1.0 < r["elapsed"] < 3.0

    # Answers that close the connection (the request asks for it) are counted, and the
    # connection is opened again; other status codes are counted without a latency.
    closing = ok.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
    r = _c_client_run(server, tmp_path, closing, 200.0, 1.0)
    assert r["codes"] == {"200": r["scheduled"]} and r["errors"] == 0
    missing = openloop.post_request("127.0.0.1", server.http_port, "/v2/models/nope/infer", body)
    r = _c_client_run(server, tmp_path, missing, 200.0, 1.0)
    assert r["codes"] == {"404": r["scheduled"]} and r["latency_ms"] == []


def test_sse_client_retries_a_pooled_connection_the_server_closed() -> None:
    """A server that answers one SSE stream per connection and then closes it (as llama.cpp's
    does): every request of a closed loop is answered, none counted as an error."""
    import asyncio

    from bench.clients import sse

    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n"
    )
    event = b'data: {"choices": [{"delta": {"content": "hi"}, "finish_reason": "length"}]}\n\n'
    for part in (event, b"data: [DONE]\n\n"):
        answer += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    answer += b"0\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        writer.write(answer)
        await writer.drain()
        writer.close()  # (after one answer, although it said keep-alive)

    async def main() -> tuple[list[sse.Stream], float]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            body = sse.chat_body("m", [{"role": "user", "content": "x"}], 4)
            return await sse.closed_loop(
                f"http://127.0.0.1:{port}/v1/chat/completions", [body] * 6, 2
            )

    streams, _ = asyncio.run(main())
    assert len(streams) == 6
    assert [s.error for s in streams] == [None] * 6
    assert all(s.text == "hi" and s.finish_reason == "length" for s in streams)
