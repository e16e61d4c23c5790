"""The dashboard says what its figures cover: the span the two compared scrapes really have
(not the window asked for, when polls come late), "since the server started" on the first
scrape, and "> 10000 ms" for a quantile past the top histogram bucket (a long generation),
not the bucket's bound. In headless Chromium (tests/test_dashboard.py's fixture) against a
real server."""

from __future__ import annotations

import json

import pytest

from tests.conftest import RunningServer
from tests.test_dashboard import DevTools, _wait_polls, browser  # noqa: F401  (fixture)


def test_window_note_and_quantiles_past_the_top_bucket(
    server: RunningServer,
    browser: DevTools,  # noqa: F811
) -> None:
    browser.call("Page.navigate", url=f"{server.base}/dashboard?window=2")
    _wait_polls(browser, 4)
    window = json.loads(browser.evaluate("JSON.stringify(window.rtserveDashboard.window)"))
    assert window["first"] is False and 1.5 <= window["seconds"] <= 4, window
    note = browser.evaluate("document.getElementById('window-note').textContent")
    assert note.startswith(f"rates and quantiles over the last {window['seconds']:.1f} s"), note
    # The note is what the scrapes span: a minute between them (a throttled background tab)
    # reads as a minute, and the first scrape as since start.
    late = browser.evaluate("windowNote(63.4, false)")
    assert "over the last 63 s" in late and "2 s asked" in late, late
    assert browser.evaluate("windowNote(0, true)").startswith("since the server started")
    # One 383 s generation in a window: its p99 is only known to be past 10 s.
    buckets = '{"0.5": 0, "1": 0, "10": 0, "+Inf": 1}'
    assert browser.evaluate(f"overTop(0.99, {buckets})") is True
    assert browser.evaluate(f"fmtQ(histogramQuantile(0.99, {buckets}), true)") == "> 10000 ms"
    inside = '{"0.005": 480, "0.01": 504, "0.025": 600, "+Inf": 600}'
    assert browser.evaluate(f"overTop(0.99, {inside})") is False
    within = '{"0.5": 0, "1": 0, "10": 1, "+Inf": 1}'
    assert browser.evaluate(f"overTop(0.99, {within})") is False
    assert browser.evaluate(f"fmtQ(histogramQuantile(0.99, {within}), false)") == "9910 ms"


@pytest.mark.parametrize("field", ["p50", "p99"])
def test_the_models_table_marks_quantiles_past_the_top_bucket(
    server: RunningServer,
    browser: DevTools,  # noqa: F811
    field: str,
) -> None:
    """render() with a model whose window holds one request slower than every bucket."""
    browser.call("Page.navigate", url=f"{server.base}/dashboard")
    _wait_polls(browser, 2)
    text = browser.evaluate(
        """(() => {
          const h = {"0.5": 0, "1": 0, "10": 0, "+Inf": 1};
          const s = {models: {slow: {outcomes: {success: 1}, hist: {rtserve_request_duration_seconds: h},
                     histCount: {}, histSum: {}, queue: 0, cache: {}, breaker: 0, objective: NaN}}, unrouted: 0};
          const figs = figures(s, null, 5);
          render(performance.now() / 1000, figs, 0, 5, false);
          return document.querySelector('[data-model="slow"][data-field="FIELD"]').textContent;
        })()""".replace("FIELD", field)
    )
    assert text == "> 10000 ms", text
