"""The benchmark report: tables, ratios to rtserve, failed peers kept as rows, goals."""

from __future__ import annotations

from pathlib import Path

from bench.report import RunRecord, fmt_ms, fmt_rps, headline_goals, render, render_details
from bench.results import Measurement


def _point(peer: str, rps: float, p99: float, client: str = "wrk", load: float = 32,
           mode: str = "closed", workload: str = "mlp") -> Measurement:  # fmt: skip
    return Measurement(peer, workload, client, mode, load, rps=rps, p50_ms=p99 / 4,
                       p90_ms=p99 / 2, p99_ms=p99, requests=1000)  # fmt: skip


def _record(**kwargs: object) -> RunRecord:
    base: dict[str, object] = dict(
        mode="full",
        command="make bench (python -m bench.run)",
        started="2026-11-22 10:00 UTC",
        duration_s=600.0,
        machine={"cpu": "Test CPU", "cores": "2"},
        versions={"onnxruntime (all servers)": "1.31.1"},
        settings={"max batch size (every batching server)": "32"},
        labels={"rtserve": "rtserve", "mosec": "mosec", "mlserver": "MLServer",
                "bare_asgi": "bare ASGI", "raw_asgi": "raw ASGI", "fastapi": "naive FastAPI"},
        order=["rtserve", "bare_asgi", "raw_asgi", "fastapi", "mlserver", "mosec"],
    )  # fmt: skip
    base.update(kwargs)
    return RunRecord(**base)  # type: ignore[arg-type]


def test_formatting_keeps_three_significant_figures() -> None:
    assert fmt_rps(12345.6) == "12,346"
    assert fmt_rps(45.61) == "45.6"
    assert fmt_ms(0.41234) == "0.412"
    assert fmt_ms(4.1234) == "4.12"
    assert fmt_ms(41.234) == "41.2"
    assert fmt_ms(4123.4) == "4,123"
    assert fmt_ms(None) == "—"


def test_render_shows_ratio_to_rtserve_and_failed_peer_with_its_error() -> None:
    record = _record(
        matrix=[
            _point("rtserve", 10000, 3.0),
            _point("mosec", 5000, 6.0),
            Measurement.failed("mlserver", "mlp", "wrk", "closed", 32, "install failed: no wheel"),
            _point("rtserve", 9000, 30.0, client="openloop-json", mode="open", load=8000),
        ],
        limits=[
            Measurement("onnxruntime", "mlp", "in-process", "limit", 32, rps=250000, p50_ms=0.12)
        ],
        plots=[("mlp closed", "img/bench-mlp-closed.png")],
    )
    text = render(record, "Benchmarks")
    assert text.startswith("# Benchmarks\n")
    assert "make bench (python -m bench.run)" in text
    assert "| Test CPU |" in text
    assert "| mosec | 32 | 5,000 | 1.50 | 3.00 | 6.00 | 0 | 0.50x |  |" in text
    assert "| rtserve | 32 | 10,000 |" in text and "| 1.00x |" in text
    assert "| MLServer | 32 | — | — | — | — | — | — | install failed: no wheel |" in text
    assert "offered req/s" in text
    assert "250,000 rows/s" in text
    assert "![mlp closed](img/bench-mlp-closed.png)" in text


def test_rows_follow_the_peer_order_then_load() -> None:
    record = _record(matrix=[_point("mosec", 1, 1.0, load=8), _point("rtserve", 2, 1.0, load=64),
                             _point("rtserve", 2, 1.0, load=1)])  # fmt: skip
    text = render(record, "B")
    first = text.index("| rtserve | 1 |")
    assert first < text.index("| rtserve | 64 |") < text.index("| mosec | 8 |")


def test_headline_goals_compare_rtserve_json_with_the_references() -> None:
    points = [
        _point("rtserve", 18000, 3.0),
        _point("bare_asgi", 30000, 2.0),
        _point("raw_asgi", 10000, 5.0),
        _point("fastapi", 2000, 50.0),
    ]
    goals = {g.name: g for g in headline_goals(points)}
    assert goals["rtserve JSON req/s vs bare ASGI (a)"].met is True
    assert goals["rtserve JSON req/s vs bare ASGI (a)"].value == "0.60x"
    assert goals["rtserve JSON req/s vs raw ASGI 1 run/request (b)"].met is True
    assert goals["rtserve JSON req/s vs naive FastAPI (c)"].met is True
    assert goals["rtserve p99 vs raw ASGI p99 (b)"].met is True


def test_headline_goals_unmeasured_when_rtserve_failed() -> None:
    points = [Measurement.failed("rtserve", "mlp", "wrk", "closed", 32, "exited with 1"),
              _point("bare_asgi", 30000, 2.0)]  # fmt: skip
    assert all(g.met is None for g in headline_goals(points))
    text = render(_record(mode="quick", headline=points), "Quick")
    assert "exited with 1" in text
    assert "not measured" in text


def test_committed_reports_exist_and_name_their_command() -> None:
    docs = Path(__file__).resolve().parent.parent / "docs"
    for name in ("benchmarks.md", "benchmarks-quick.md"):
        path = docs / name
        if path.exists():
            text = path.read_text()
            assert "python -m bench.run" in text
            assert "## Machine" in text


def test_open_loop_ratio_compares_p99_not_throughput() -> None:
    record = _record(
        matrix=[
            _point("rtserve", 1000, 4.0, client="openloop-json", mode="open", load=1000),
            _point("mosec", 1000, 8.0, client="openloop-json", mode="open", load=1000),
        ]
    )
    text = render(record, "B")
    assert "p99 × rtserve" in text
    assert "| mosec | 1000 | 1,000 | 2.00 | 4.00 | 8.00 | 0 | 2.00x |  |" in text


def test_a_peer_failing_every_point_the_same_way_gets_one_row() -> None:
    failed = [Measurement.failed("mlserver", "mlp", "pa-grpc", "closed", c, "Method not found!")
              for c in (1, 8, 32, 64)]  # fmt: skip
    text = render(_record(matrix=[_point("rtserve", 5000, 4.0, client="pa-grpc"), *failed]), "B")
    assert text.count("Method not found!") == 1
    assert "| MLServer | 1–64 | — |" in text


def test_plots_write_png_files(tmp_path: Path) -> None:
    from bench import plots

    closed = [_point(p, rps, p99, load=c) for p, rps, p99, c in
              (("rtserve", 500, 2.0, 1), ("rtserve", 9000, 4.0, 32), ("mosec", 7000, 6.0, 32))]  # fmt: skip
    failed = Measurement.failed("mlserver", "mlp", "wrk", "closed", 32, "down")
    out = plots.draw("closed", [*closed, failed], ["rtserve", "mosec"], {}, "t", tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    opened = [_point("rtserve", 1000, 2.0, client="openloop-json", mode="open", load=1000)]
    out = plots.draw("open", opened, ["rtserve"], {}, "t", tmp_path / "o.png")
    assert out.exists()


def _round(peer: str, rps: float, round_no: int) -> Measurement:
    m = _point(peer, rps, 2.0)
    m.round = round_no
    return m


def test_headline_is_the_median_of_per_round_ratios_with_each_round_shown() -> None:
    from bench.stats import combine_rounds

    rounds = []
    for i, (rt, bare, base) in enumerate(
        [(600, 1000, 600), (1400, 2000, 1300), (500, 1000, 520), (650, 1000, 650), (610, 1000, 600)]
    ):
        rounds += [_round("rtserve", rt, i), _round("bare_asgi", bare, i),
                   _round("rtserve_baseline", base, i)]  # fmt: skip
    record = _record(
        mode="quick",
        headline=combine_rounds(rounds),
        headline_rounds=rounds,
        baseline="`HEAD~1` = abc1234567 (a change)",
        labels={
            "rtserve": "rtserve",
            "bare_asgi": "bare ASGI",
            "rtserve_baseline": "rtserve @ HEAD~1 (abc1234567)",
        },  # fmt: skip
    )
    text = render(record, "Quick")
    # per-round ratios 0.60, 0.70, 0.50, 0.65, 0.61: median 0.61 (ratio of medians: 0.61 too,
    # but the rounds differ); vs the baseline 1.00, 1.08, 0.96, 1.00, 1.02: median 1.00
    assert "median of 5 per-round ratios" in text
    assert "rtserve reaches 0.61x of bare ASGI; 1.00x of rtserve @ HEAD~1 (abc1234567)" in text
    assert "| 2 | 1,400 | 0.70x | 1.08x |" in text
    assert "| 3 | 500 | 0.50x | 0.96x |" in text
    assert "| **median** |  | **0.61x** | **1.00x** |" in text
    assert "rtserve as of `HEAD~1` = abc1234567 (a change)" in text
    goals = {g.name: g for g in headline_goals(record.headline, rounds)}
    assert goals["rtserve JSON req/s vs bare ASGI (a)"].value == "0.61x"
    assert goals["rtserve JSON req/s vs raw ASGI 1 run/request (b)"].met is None


def test_a_failed_round_shows_a_dash_and_is_left_out_of_the_median() -> None:
    from bench.stats import combine_rounds

    rounds = [_round("rtserve", 600, 0), _round("bare_asgi", 1000, 0),
              _round("rtserve", 900, 1), Measurement.failed("bare_asgi", "mlp", "wrk", "closed", 32, "x"),
              _round("rtserve", 800, 2), _round("bare_asgi", 1000, 2)]  # fmt: skip
    rounds[3].round = 1
    record = _record(mode="quick", headline=combine_rounds(rounds), headline_rounds=rounds)
    text = render(record, "Quick")
    assert "| 2 | 900 | — |" in text
    assert "| **median** |  | **0.70x** |" in text


def test_slo_plots_are_embedded_when_present(tmp_path: Path) -> None:
    from bench.report import slo_section

    assert slo_section(tmp_path) == []
    (tmp_path / "minilm-seq32.png").write_bytes(b"\x89PNG")
    lines = slo_section(tmp_path)
    assert "![minilm-seq32](../bench/results/slo/minilm-seq32.png)" in lines
    assert any("benchmarks-slo.md" in line for line in lines)


def test_a_full_report_links_its_load_points_instead_of_holding_them() -> None:
    record = _record(matrix=[_point("rtserve", 5000, 4.0)])
    record.plots = [("mlp: closed loop", "img/bench-mlp-closed.png")]
    page = render(record, "Benchmarks", details="../bench/results/benchmarks-detail.md")
    details = render_details(record, "Benchmarks")
    assert "## Workload: mlp" not in page and "## Workload: mlp" in details
    assert "(../bench/results/benchmarks-detail.md)" in page
    assert "](../../docs/img/bench-mlp-closed.png)" in details
    assert "## Workload: mlp" in render(record, "Benchmarks")  # one page without ``details``
