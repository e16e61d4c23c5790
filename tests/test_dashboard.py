"""The live dashboard at /dashboard, in headless Chromium against a server under load: its
figures appear, change from second to second, and agree with /metrics; its generative-models
section shows a tiny ``backend: llm`` model served by two workers (and stays hidden without
one), whose merged /metrics keeps every family once and adds the workers up; and the Grafana
dashboard in deploy/ reads only metrics that a real server exposes.

Chromium (Debian's ``chromium``, installed by ``make system-deps``) is driven over the
DevTools protocol with the ``websockets`` client; without a Chromium the browser test skips.
Set ``RTSERVE_DASHBOARD_SCREENSHOT=docs/img/dashboard.png`` to refresh the screenshot in docs.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from rtserve.observability.workers import PUBLISH_PERIOD_S
from tests.conftest import RunningServer, start_server
from tests.llm_models import build_llm
from tests.metrics_load import loaded_server, sample_names, sample_value, scrape

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana" / "rtserve-dashboard.json"
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
FIGURES_JS = """JSON.stringify({
  polls: window.rtserveDashboard ? window.rtserveDashboard.polls : 0,
  failures: window.rtserveDashboard ? window.rtserveDashboard.failures : 0,
  cells: Array.from(document.querySelectorAll('[data-field]'),
                    e => [e.dataset.model || '', e.dataset.field, e.textContent.trim()]),
})"""


class DevTools:
    """A minimal Chrome DevTools protocol client over one page's websocket."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == call_id:
                assert "error" not in msg, msg
                return dict(msg["result"])
            self.events.append(msg)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def errors(self) -> list[str]:
        """Uncaught exceptions and console errors seen so far."""
        out = []
        for e in self.events:
            if e.get("method") == "Runtime.exceptionThrown":
                out.append(json.dumps(e["params"]["exceptionDetails"])[:500])
            elif e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] == "error":
                out.append(json.dumps(e["params"]["args"])[:500])
        return out


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[DevTools]:
    if CHROMIUM is None:
        pytest.skip("chromium not installed")
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--no-first-run", "--no-default-browser-check",
            "--disable-extensions", "--disable-sync", "--mute-audio",
            f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0", "--window-size=1280,1000", "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert proc.poll() is None, "chromium exited at start"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [
            t
            for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            if t["type"] == "page"
        ]
        with connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10) as ws:
            tools = DevTools(ws)
            tools.call("Runtime.enable")
            tools.call("Page.enable")
            yield tools
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _figures(tools: DevTools) -> tuple[int, dict[tuple[str, str], str]]:
    doc = json.loads(tools.evaluate(FIGURES_JS))
    assert doc["failures"] == 0, tools.evaluate("window.rtserveDashboard.lastError")
    return doc["polls"], {(m, f): text for m, f, text in doc["cells"]}


def _wait_polls(tools: DevTools, at_least: int, timeout: float = 20) -> dict[tuple[str, str], str]:
    deadline = time.monotonic() + timeout
    while True:
        polls, cells = _figures(tools)
        if polls >= at_least:
            return cells
        assert time.monotonic() < deadline, f"the page polled {polls} times, not {at_least}"
        time.sleep(0.2)


def _number(text: str) -> float:
    match = re.fullmatch(r"([0-9][0-9,]*(?:\.[0-9]+)?)(?: ms| %)?", text)
    assert match, f"not a figure: {text!r}"
    return float(match.group(1).replace(",", ""))


def test_dashboard_is_one_self_contained_html_page(tmp_path: Path) -> None:
    with loaded_server(tmp_path, threads=1) as (server, _):
        r = httpx.get(f"{server.base}/dashboard", timeout=10)
        head = httpx.head(f"{server.base}/dashboard", timeout=10)
    assert r.status_code == 200 and head.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    page = r.text
    assert page.lstrip().lower().startswith("<!doctype html>")
    assert "<canvas" in page and 'fetch("/metrics"' in page
    # No build step and nothing fetched from elsewhere: no external scripts, styles or URLs.
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", page, re.IGNORECASE)
    assert not re.search(r"https?://", page)


def test_dashboard_figures_appear_change_and_match_metrics(
    tmp_path: Path, browser: DevTools
) -> None:
    with loaded_server(tmp_path) as (server, load):
        browser.call("Emulation.setDeviceMetricsOverride", width=1280, height=1000,
                     deviceScaleFactor=1, mobile=False)  # fmt: skip
        browser.call("Page.navigate", url=f"{server.base}/dashboard?window=2")
        first = _wait_polls(browser, 3)
        # The page's quantile is Prometheus' (the same buckets as the promtool unit test).
        buckets = '{"0.005": 480, "0.01": 504, "0.025": 600, "+Inf": 600}'
        for q, expected in ((0.5, 0.003125), (0.95, 0.0203125), (0.99, 0.0240625)):
            assert browser.evaluate(f"histogramQuantile({q}, {buckets})") == pytest.approx(expected)
        parsed = browser.evaluate(
            r"""parseExposition('a_total{model="m\\"x",le="+Inf"} 3 1700000000\n# HELP x\nb NaN')"""
        )
        assert parsed[0] == {
            "name": "a_total",
            "labels": {"model": 'm"x', "le": "+Inf"},
            "value": 3,
        }
        assert parsed[1]["name"] == "b" and len(parsed) == 2
        polls, _ = _figures(browser)
        second = _wait_polls(browser, polls + 2)

        for cells in (first, second):
            for model in ("mlp", "scale"):
                assert _number(cells[(model, "throughput")]) > 0, cells
                assert cells[(model, "p99")].endswith(" ms"), cells
                assert _number(cells[(model, "p50")]) <= _number(cells[(model, "p99")])
            assert _number(cells[("mlp", "batch_mean")]) >= 1
            assert cells[("mlp", "cache_hit_ratio")] == "no cache"
            assert cells[("mlp", "objective")] == "250 ms"  # its config's slo.p99_ms
            assert cells[("scale", "objective")] == "–"
            assert 0 < _number(cells[("scale", "cache_hit_ratio")]) <= 100
            assert not any(field.startswith("llm:") for _, field in cells)
            assert _number(cells[("mlp", "errors:client_error")]) > 0
        # Live: the totals grow from one read to the next.
        for model in ("mlp", "scale"):
            assert _number(second[(model, "requests_total")]) > _number(
                first[(model, "requests_total")]
            )
        assert _number(second[("mlp", "errors_total")]) > _number(first[("mlp", "errors_total")])

        target = os.environ.get("RTSERVE_DASHBOARD_SCREENSHOT")
        if target:  # for the docs: let the charts fill with a minute of history first
            _wait_polls(browser, polls + 60, timeout=120)
        height = browser.evaluate("document.documentElement.scrollHeight")
        browser.call("Emulation.setDeviceMetricsOverride", width=1280, height=height,
                     deviceScaleFactor=1, mobile=False)  # fmt: skip
        _wait_polls(browser, _figures(browser)[0] + 1)  # redrawn at the full height
        shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        assert shot.startswith(b"\x89PNG") and len(shot) > 20_000
        (tmp_path / "dashboard.png").write_bytes(shot)
        if target:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            Path(target).write_bytes(shot)

        load.stop()
        polls, _ = _figures(browser)
        quiet = _wait_polls(browser, polls + 4)  # the 2 s window has passed
        exposition = scrape(server)

    # Once the load stops, the page's totals are the server's counters, parsed in the browser.
    for model in ("mlp", "scale"):
        total = sample_value(exposition, "rtserve_requests_total", model=model)
        errors = total - sample_value(
            exposition, "rtserve_requests_total", model=model, outcome="success"
        )
        assert _number(quiet[(model, "requests_total")]) == total
        assert _number(quiet[(model, "errors_total")]) == errors
        assert quiet[(model, "throughput")] == "0.0"
    assert browser.evaluate("document.getElementById('llm').hidden") is True  # no llm model
    assert browser.errors() == []


def _grafana_exprs(doc: dict[str, Any]) -> list[str]:
    panels = list(doc["panels"])
    for p in list(panels):
        panels.extend(p.get("panels", []))
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    exprs += [
        v.get("query", {}).get("query", "") if isinstance(v.get("query"), dict) else v["query"]
        for v in doc.get("templating", {}).get("list", [])
        if v.get("type") == "query"
    ]
    return exprs


def test_grafana_dashboard_reads_only_metrics_a_server_exposes(
    tmp_path: Path, llm_server: RunningServer
) -> None:
    doc = json.loads(GRAFANA.read_text())
    assert doc["title"] and doc["uid"] and doc["panels"]
    exprs = _grafana_exprs(doc)
    assert len(exprs) >= 8
    titles = " ".join(p["title"].lower() for p in doc["panels"])
    for topic in ("throughput", "latency", "batch", "queue", "cache", "error", "generative"):
        assert topic in titles, f"no panel about {topic}"
    used = {name for e in exprs for name in re.findall(r"\brtserve_[a-z_]+\b", e)}
    assert {"rtserve_requests_total", "rtserve_request_duration_seconds_bucket"} <= used
    assert {
        "rtserve_llm_time_to_first_token_seconds_bucket",
        "rtserve_llm_inter_token_latency_seconds_bucket",
        "rtserve_llm_generation_tokens_total",
        "rtserve_llm_kv_blocks_used",
        "rtserve_llm_kv_blocks_capacity",
        "rtserve_llm_prefix_cache_hits_total",
        "rtserve_llm_requests_finished_total",
    } <= used

    with loaded_server(tmp_path, threads=1) as (server, load):
        deadline = time.monotonic() + 20
        while load.sent() < 400 and time.monotonic() < deadline:
            time.sleep(0.1)
        exposed = sample_names(scrape(server))
    exposed |= sample_names(scrape(llm_server))
    assert used <= exposed, f"the dashboard reads metrics no server exposes: {used - exposed}"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_grafana_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every panel's query parses (as a recording rule, Grafana's variables filled in)."""
    doc = json.loads(GRAFANA.read_text())
    filled = [
        e.replace("$__rate_interval", "1m").replace("$model", ".*")
        for e in _grafana_exprs(doc)
        if not e.startswith("label_values(")
    ]
    rules = [{"record": f"grafana:query{i}", "expr": e} for i, e in enumerate(filled)]
    path = tmp_path / "grafana-rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "grafana", "rules": rules}]}))
    r = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


ADMIN_KEY = "dashboard-admin-key-0123456789"
STATE_JS = """window.rtserveDashboard && JSON.stringify({
  polls: window.rtserveDashboard.polls, failures: window.rtserveDashboard.failures,
  status: document.getElementById('status').textContent,
  first: window.rtserveDashboard.firstCharts, charts: window.rtserveDashboard.charts,
  legend: Array.from(document.querySelectorAll('#legend-c-throughput [data-legend]'),
                     e => e.dataset.legend),
})"""


def _state(tools: DevTools) -> dict[str, Any]:
    """The page's figures and charts; empty until the page has loaded."""
    raw = tools.evaluate(STATE_JS)
    doc: dict[str, Any] = json.loads(raw) if raw else {"polls": 0, "failures": 0}
    return doc


def _wait_state(tools: DevTools, ok: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not ok(state := _state(tools)):
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    return state


@pytest.fixture
def eight_models(tmp_path: Path) -> Iterator[Any]:
    from tests.conftest import start_server
    from tests.models import build_scale

    repo = tmp_path / "repo"
    names = [f"model{i}" for i in range(8)]
    for i, name in enumerate(names):
        build_scale(repo / name / "1" / "model.onnx", float(i + 1))
        (repo / name / "config.yaml").write_text("max_batch_size: 4\n")
    auth = tmp_path / "auth.yaml"
    auth.write_text(f"keys:\n  - {{name: ops, token: {ADMIN_KEY}, admin: true}}\n")
    server = start_server(repo, tmp_path / "server", "--auth-file", str(auth))
    try:
        body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}]}
        for name in names:
            r = httpx.post(
                f"{server.base}/v2/models/{name}/infer",
                json=body,
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                timeout=10,
            )
            assert r.status_code == 200, r.text
        yield server, names
    finally:
        server.stop()


def test_dashboard_with_auth_sends_the_key_and_draws_every_model_from_the_first_scrape(
    eight_models: Any, browser: DevTools
) -> None:
    server, names = eight_models
    assert httpx.get(f"{server.base}/metrics", timeout=10).status_code == 401
    browser.call("Network.enable")
    # interval=10: a chart drawn within ~1 s shows the first scrape (and the fast second).
    browser.call("Page.navigate", url=f"{server.base}/dashboard?interval=10")
    asked = _wait_state(browser, lambda s: s["failures"] >= 1, 15)
    assert "401" in asked["status"] and "API key" in asked["status"], asked
    assert asked["polls"] == 0

    browser.evaluate(
        f"document.getElementById('key').value = {json.dumps(ADMIN_KEY)};"
        "document.querySelector('#key-form button').click(); 1"
    )
    first = _wait_state(browser, lambda s: s["polls"] >= 1, 10)
    # The first scrape already draws latency and queue depth for every model.
    assert first["first"]["c-latency"] == {"series": 8, "points": 3 * 8}, first
    assert first["first"]["c-queue"] == {"series": 8, "points": 8}, first
    second = _wait_state(browser, lambda s: s["polls"] >= 2, 4)  # not 10 s later
    assert second["charts"]["c-throughput"]["points"] >= 8, second
    assert second["legend"] == names  # all eight, none dropped
    assert browser.evaluate("sessionStorage.getItem('rtserve-dashboard-key')") == ADMIN_KEY
    sent = [
        e["params"]["request"]["headers"]
        for e in browser.events
        if e.get("method") == "Network.requestWillBeSent"
        and e["params"]["request"]["url"].endswith("/metrics")
    ]
    assert sent and "Authorization" not in sent[0]  # before a key was typed
    assert sent[-1].get("Authorization") == f"Bearer {ADMIN_KEY}"
    assert browser.errors() == []


# ---------------------------------------------------------------------- generative models
LLM = "tiny"
TTFT_OBJECTIVE_MS = 5000  # loose: a shared 2-core machine must not refuse the test's load
SYSTEM = "You answer in one short sentence about cats, dogs and the weather today. " * 3
# One worker's pool: 8 MiB over (K and V, 2 layers, 2 KV heads of 16 floats, 16 tokens).
POOL_BLOCKS = (8 << 20) // (2 * 2 * 2 * 16 * 4 * 16)


def _chat(base: str, i: int, max_tokens: int = 12) -> None:
    """One chat completion on a fresh connection (the kernel spreads them over workers)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"cat {i}"}]
    body = {"model": LLM, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A tiny random-weight Llama with a first-token objective, served by two workers."""
    root = tmp_path_factory.mktemp("llm-repo")
    build_llm(root, LLM, slo={"ttft_p99_ms": TTFT_OBJECTIVE_MS})
    server = start_server(root, tmp_path_factory.mktemp("llm-server"), "--workers", "2")
    try:
        _chat(server.base, 0)
        yield server
    finally:
        server.stop()


class LlmLoad:
    """Client threads sending chat completions until stopped."""

    def __init__(self, base: str, threads: int = 3) -> None:
        self.base = base
        self.sent = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            _chat(self.base, self.sent)
            self.sent += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def _merged_scrape(server: RunningServer) -> str:
    time.sleep(2 * PUBLISH_PERIOD_S)  # every worker has published what it answered
    return scrape(server)


def test_llm_metrics_merge_across_two_workers(llm_server: RunningServer) -> None:
    """With --workers 2 every rtserve_llm_* family appears once, counters add up to the
    requests sent, pool sizes add up and the objective is the model's, not doubled."""
    before = _merged_scrape(llm_server)
    sent = 10
    for i in range(sent):
        _chat(llm_server.base, i, max_tokens=6)
    text = _merged_scrape(llm_server)

    types = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE)
    assert len(types) == len({name for name, _ in types}), "a family declared twice"
    declared = dict(types)
    assert declared["rtserve_llm_request_prompt_tokens"] == "histogram"
    assert declared["rtserve_llm_prompt_tokens_total"] == "counter"
    # one family a name in Prometheus' model too (a counter's family drops "_total": the
    # per-request histograms shared the counters' names before)
    from prometheus_client.parser import text_string_to_metric_families

    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    if PROMTOOL := shutil.which("promtool"):
        r = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr

    def grew(name: str, **labels: str) -> float:
        return sample_value(text, name, model=LLM, **labels) - sample_value(
            before, name, model=LLM, **labels
        )

    assert grew("rtserve_llm_requests_finished_total", reason="length") == sent
    assert grew("rtserve_llm_time_to_first_token_seconds_count") == sent
    assert grew("rtserve_llm_generation_tokens_total") == 6 * sent
    assert (
        grew("rtserve_llm_prompt_tokens_total") == grew("rtserve_llm_request_prompt_tokens_sum") > 0
    )
    assert sample_value(text, "rtserve_llm_kv_blocks_capacity", model=LLM) == 2 * POOL_BLOCKS
    assert sample_value(text, "rtserve_llm_kv_blocks_used", model=LLM) == 0
    assert sample_value(
        text, "rtserve_llm_objective_seconds", model=LLM, objective="ttft_p99"
    ) == pytest.approx(TTFT_OBJECTIVE_MS / 1000)


def test_dashboard_shows_generative_models(
    tmp_path: Path, llm_server: RunningServer, browser: DevTools
) -> None:
    browser.call("Emulation.setDeviceMetricsOverride", width=1280, height=1000,
                 deviceScaleFactor=1, mobile=False)  # fmt: skip
    load = LlmLoad(llm_server.base)
    try:
        browser.call("Page.navigate", url=f"{llm_server.base}/dashboard?window=3")
        cells = _wait_polls(browser, 4)
        assert browser.evaluate("document.getElementById('llm').hidden") is False
        assert _number(cells[(LLM, "llm:tokens_per_s")]) > 0, cells
        assert _number(cells[(LLM, "llm:ttft_p50")]) <= _number(cells[(LLM, "llm:ttft_p99")])
        assert _number(cells[(LLM, "llm:itl_p50")]) <= _number(cells[(LLM, "llm:itl_p99")])
        assert cells[(LLM, "llm:ttft_objective")] == f"{TTFT_OBJECTIVE_MS} ms"
        assert 0 < _number(cells[(LLM, "llm:prefix_hit")]) <= 100  # the shared system prompt
        assert _number(cells[(LLM, "llm:finished:length")]) > 0
        assert cells[(LLM, "llm:kv_blocks")].endswith(f" / {2 * POOL_BLOCKS:,}")
        charts = json.loads(browser.evaluate("JSON.stringify(window.rtserveDashboard.charts)"))
        assert charts["c-llm-tokens"]["points"] >= 2 and charts["c-llm-latency"]["series"] == 1
        height = browser.evaluate("document.documentElement.scrollHeight")
        browser.call("Emulation.setDeviceMetricsOverride", width=1280, height=height,
                     deviceScaleFactor=1, mobile=False)  # fmt: skip
        _wait_polls(browser, _figures(browser)[0] + 1)
        shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        assert shot.startswith(b"\x89PNG")
        target = os.environ.get("RTSERVE_LLM_DASHBOARD_SCREENSHOT")
        Path(target or tmp_path / "dashboard-llm.png").write_bytes(shot)
    finally:
        load.stop()
    quiet = _wait_polls(browser, _figures(browser)[0] + 5)  # the 3 s window has passed
    text = _merged_scrape(llm_server)
    # Idle: the page's totals and gauges are the merged /metrics, parsed in the browser.
    for reason in ("stop", "length", "abort"):
        total = sample_value(text, "rtserve_llm_requests_finished_total", reason=reason)
        assert _number(quiet[(LLM, f"llm:finished:{reason}")]) == total
    assert quiet[(LLM, "llm:tokens_per_s")] == "0.0"
    assert quiet[(LLM, "llm:running")] == "0" and quiet[(LLM, "llm:waiting")] == "0"
    assert quiet[(LLM, "llm:kv_blocks")] == f"0 / {2 * POOL_BLOCKS:,}"
    assert browser.errors() == []
