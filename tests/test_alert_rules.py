"""The Prometheus rules in deploy/ are valid, their unit tests pass, and they read metrics
that a real server exposes (those of generative models: that rtserve's llm collector
exposes); the server's exposition passes ``promtool check metrics``.

promtool comes from Debian's ``prometheus`` package (``make system-deps`` installs only the
binary); without it these tests skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from rtserve.observability.workers import PUBLISH_PERIOD_S
from rtserve.runtime.llm.metrics import LlmCollector, LlmMetrics, token_objectives
from rtserve.runtime.llm.options import TokenSLO
from tests.metrics_load import loaded_server, sample_names, sample_value, scrape

PROMETHEUS = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULES = PROMETHEUS / "rtserve-rules.yml"
RULE_TESTS = PROMETHEUS / "rtserve-rules.test.yml"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")

ALERTS = {
    "RtserveLatencyP95AboveObjective",
    "RtserveLatencyP99AboveObjective",
    "RtserveErrorRatioHigh",
    "RtserveQueueSaturated",
    "RtserveSheddingLoad",
    "RtserveCacheBreakerOpen",
    "RtserveLlmTimeToFirstTokenAboveObjective",
    "RtserveLlmKvCacheExhausted",
}


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def _rules() -> list[dict[str, object]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _read_by_rules() -> set[str]:
    rule_text = " ".join(str(rule["expr"]) for rule in _rules())
    return set(re.findall(r"\brtserve_[a-z_]+\b", rule_text))


def test_promtool_check_rules_accepts_the_rules() -> None:
    r = _promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_passing_promtool_unit_test() -> None:
    alerts = {str(rule["alert"]) for rule in _rules() if "alert" in rule}
    assert alerts == ALERTS
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == alerts, f"alerts without a unit test: {alerts - tested}"
    r = _promtool("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_test_rules_fails_when_an_alert_misbehaves(tmp_path: Path) -> None:
    """The unit tests can fail: with the error threshold moved, they do."""
    (tmp_path / RULES.name).write_text(
        RULES.read_text().replace("ratio_rate5m > 0.01", "ratio_rate5m > 0.05")
    )
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    r = _promtool("test", "rules", str(tmp_path / RULE_TESTS.name))
    assert r.returncode != 0
    assert "RtserveErrorRatioHigh" in r.stdout + r.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_scrape_under_load_passes_promtool_and_has_what_the_rules_read(
    tmp_path: Path, workers: str
) -> None:
    """One process, and the merged view of two worker processes."""
    with loaded_server(tmp_path, "--workers", workers) as (server, load):
        deadline = time.monotonic() + 20
        # Until a malformed request has had its 400: one sent while the mlp's admission
        # refuses before decoding gets 429 instead (its model has an objective).
        while (load.sent() < 200 or not load.statuses[400]) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2 * PUBLISH_PERIOD_S)  # every worker has published what it answered
        exposition = scrape(server)
    assert load.statuses[200] > 100, load.statuses
    r = _promtool("check", "metrics", stdin=exposition)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr

    assert sample_value(exposition, "rtserve_requests_total", model="mlp", outcome="success") > 0
    assert sample_value(exposition, "rtserve_requests_total", outcome="client_error") > 0
    assert sample_value(exposition, "rtserve_cache_requests_total", result="hit") > 0
    assert sample_value(exposition, "rtserve_batch_size_count", model="mlp") > 0

    exposed = sample_names(exposition)
    read = {name for name in _read_by_rules() if not name.startswith("rtserve_llm_")}
    assert read, "the rules read no rtserve metrics"
    assert read <= exposed, f"rules read metrics the server does not expose: {read - exposed}"


def test_rules_read_llm_metrics_the_llm_collector_exposes() -> None:
    """The generative models' metrics, from the collector a server registers for them."""
    collector = LlmCollector()
    collector.models = [
        LlmMetrics("chat", "1", objectives=token_objectives(TokenSLO(ttft_p99_ms=500)))
    ]
    registry = CollectorRegistry()
    registry.register(collector)
    exposed = sample_names(generate_latest(registry).decode())
    read = {name for name in _read_by_rules() if name.startswith("rtserve_llm_")}
    assert {"rtserve_llm_objective_seconds", "rtserve_llm_kv_blocks_capacity"} <= read
    assert read <= exposed, f"rules read metrics the collector does not expose: {read - exposed}"
