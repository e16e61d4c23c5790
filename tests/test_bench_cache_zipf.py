"""The response-cache benchmark: its stream, its report, and the suite helpers it runs on."""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from bench import cache_zipf
from bench.clients import wrk
from bench.procs import RedisServer, alive
from bench.results import write_section

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_repeat_rate_counts_requests_whose_input_came_before() -> None:
    stream = np.array([1, 2, 1, 0, 2, 2, 0, 3])
    assert cache_zipf.repeat_rate(stream) == pytest.approx(3 / 8)


def test_stream_is_bisected_to_the_target_repeat_rate() -> None:
    stream, rate = cache_zipf.stream_for(20_000, 500, 1.0, 0.5, seed=0)
    assert len(stream) == 20_000 and stream.min() >= 0 and stream.max() <= 500
    assert abs(rate - 0.5) < 0.005
    assert cache_zipf.repeat_rate(stream) == pytest.approx(rate)


def test_cache_config_follows_the_setup() -> None:
    by_name = {s.name: s for s in cache_zipf.SETUPS}
    assert cache_zipf.cache_config(by_name["no cache"], "redis://x", 10) == {}
    both = cache_zipf.cache_config(by_name["L1 + L2"], "redis://127.0.0.1:1/0", 1024)
    assert both["response_cache"]["memory"]["max_bytes"] == 1024
    assert both["response_cache"]["redis"]["url"] == "redis://127.0.0.1:1/0"
    assert (
        "redis"
        not in cache_zipf.cache_config(by_name["L1 only (memory)"], "r", 1)["response_cache"]
    )


def test_each_model_rewrites_only_its_own_section(tmp_path: pathlib.Path) -> None:
    page = tmp_path / "cache.md"
    write_section(page, "cache_zipf: mlp", "## MLP v1")
    write_section(page, "cache_zipf: minilm", "## MiniLM v1")
    write_section(page, "cache_zipf: minilm", "## MiniLM v2")
    text = page.read_text()
    assert "## MiniLM v1" not in text and "## MiniLM v2" in text and "## MLP v1" in text
    assert text.index("## MLP v1") < text.index("## MiniLM v2")


def test_report_table_shows_ratio_to_no_cache_and_hit_counts() -> None:
    results = [
        cache_zipf.Result("no cache", 10_000, 2.0, 6.0, 50_000, 0, {"miss": 50_000}),
        cache_zipf.Result(
            "L1 only (memory)",
            15_000,
            1.5,
            5.0,
            75_000,
            0,
            {"memory": 37_500, "miss": 37_500},
            server_cpu_us=40,
        ),  # fmt: skip
    ]
    args = argparse.Namespace(argv=["--quick"], connections=32, duration=5, hot=2000,
                              exponent=1.0, rounds=1)  # fmt: skip
    stream = np.array([1, 1, 0, 2])
    text = cache_zipf.report(results, args, 0.25, stream)
    assert "Command: `python -m bench.cache_zipf --quick`" in text
    assert (
        "| L1 only (memory) | 15,000 | 1.50x | 1.50 | 5.00 | 40 | 50.0% | 37,500 | 0 | 0 | 0 |"
        in text
    )
    assert "| --- | ---: |" in text
    assert "cores, Python" in text


def test_wrk_done_counts_reads_the_scripts_extra_counters() -> None:
    line = ('BENCH_JSON {"requests":10,"duration_us":1000000,"connect":0,"read":0,"write":0,'
            '"status":0,"timeout":0,"p50_us":1,"p90_us":2,"p99_us":3,"memory":4,"miss":6}')  # fmt: skip
    assert wrk.done_counts("noise\n" + line + "\n") == {"memory": 4, "miss": 6}
    assert wrk.parse(line)["requests"] == 10
    assert wrk.done_counts("no json here") == {}


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_redis_server_helper_starts_flushes_and_stops(tmp_path: pathlib.Path) -> None:
    server = RedisServer(tmp_path)
    try:
        assert server.url.startswith("redis://127.0.0.1:")
        server.client.set("k", b"v")
        assert server.client.get("k") == b"v"
        server.flush()
        assert server.client.get("k") is None
    finally:
        server.stop()
    assert not alive(server.server.pid)


def test_command_line_help_still_works() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cache_zipf", "--help"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--model {mlp,minilm,all}" in proc.stdout
