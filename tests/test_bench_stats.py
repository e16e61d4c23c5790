"""The benchmark suite's arithmetic: percentiles, ratios, medians over rounds, saturation."""

from __future__ import annotations

import pytest

from bench.results import Measurement, load, save, short_error
from bench.stats import combine_rounds, percentile, ratio, saturated


def test_percentile_interpolates_linearly_like_numpy() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_ratio_handles_missing_and_zero_references() -> None:
    assert ratio(300.0, 100.0) == 3.0
    assert ratio(None, 100.0) is None
    assert ratio(100.0, None) is None
    assert ratio(100.0, 0.0) is None
    assert ratio(float("nan"), 1.0) is None


def _m(rps: float, p99: float, round_no: int, error: str | None = None) -> Measurement:
    return Measurement("rtserve", "mlp", "wrk", "closed", 32, rps=rps, p50_ms=1.0, p90_ms=2.0,
                       p99_ms=p99, errors=1, requests=100, error=error, round=round_no)  # fmt: skip


def test_combine_rounds_takes_medians_and_sums_errors() -> None:
    merged = combine_rounds([_m(100, 9, 0), _m(300, 3, 1), _m(200, 5, 2)])
    assert len(merged) == 1
    m = merged[0]
    assert m.rps == 200
    assert m.p99_ms == 5
    assert m.errors == 3
    assert m.extra["rounds_rps"] == [100, 300, 200]


def test_combine_rounds_ignores_failed_rounds_but_says_so() -> None:
    merged = combine_rounds([_m(100, 9, 0), _m(0, 0, 1, error="boom"), _m(300, 3, 2)])[0]
    assert merged.ok
    assert merged.rps == 200
    assert merged.extra["failed_rounds"] == 1


def test_combine_rounds_keeps_error_when_every_round_failed() -> None:
    merged = combine_rounds([_m(0, 0, 0, error="refused"), _m(0, 0, 1, error="refused")])[0]
    assert not merged.ok
    assert merged.error == "refused"


def test_saturated_when_throughput_lags_or_requests_are_left() -> None:
    open_point = Measurement("x", "mlp", "openloop-json", "open", 1000, rps=750, p99_ms=3.0)
    assert not saturated(open_point)
    assert saturated(Measurement("x", "mlp", "openloop-json", "open", 1000, rps=650, p99_ms=3.0))
    left = Measurement("x", "mlp", "openloop-json", "open", 1000, rps=990, p99_ms=3.0)
    left.extra["unfinished"] = 5
    assert saturated(left)
    assert saturated(Measurement("x", "mlp", "openloop-json", "open", 10, rps=10, p99_ms=5000))
    assert saturated(Measurement.failed("x", "mlp", "openloop-json", "open", 10, "down"))


def test_short_error_is_one_bounded_line() -> None:
    text = "Traceback:\n  line one\n" + "x" * 500
    short = short_error(text, limit=50)
    assert "\n" not in short
    assert len(short) == 50


def test_measurements_round_trip_through_jsonl(tmp_path) -> None:  # type: ignore[no-untyped-def]
    items = [_m(100, 9, 0), Measurement.failed("mosec", "minilm", "wrk", "closed", 8, "no")]
    items[0].extra["command"] = "wrk -c32"
    save(tmp_path / "r.jsonl", items)
    assert load(tmp_path / "r.jsonl") == items


def _wrk(peer: str, rps: float, round_no: int, error: str | None = None) -> Measurement:
    return Measurement(peer, "mlp", "wrk", "closed", 32, rps=rps, round=round_no, error=error)


def test_round_ratios_pair_servers_of_the_same_round() -> None:
    from bench.stats import median_ratio, round_ratios

    points = [
        _wrk("rtserve", 600, 0), _wrk("bare_asgi", 1000, 0),
        _wrk("bare_asgi", 2000, 1), _wrk("rtserve", 1400, 1),  # a faster round
        _wrk("rtserve", 500, 2), _wrk("bare_asgi", 1000, 2, error="refused"),
        _wrk("rtserve", 650, 3), _wrk("bare_asgi", 1000, 3),
        Measurement("rtserve", "mlp", "pa-grpc", "closed", 32, rps=9999, round=3),
    ]  # fmt: skip
    rows = round_ratios(points, "rtserve", ["bare_asgi"])
    assert [r["bare_asgi"] for r in rows] == [0.6, 0.7, None, 0.65]
    assert median_ratio(rows, "bare_asgi") == pytest.approx(0.65)
    assert median_ratio([], "bare_asgi") is None
