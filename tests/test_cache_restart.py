"""The Redis config the docs show survives a restart: a real redis-server, a real server
started with the snippet from docs/cache.md (and README.md), stopped, started again."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.cache_fixtures import RedisServer, redis_server  # noqa: F401  (fixture)
from tests.conftest import RunningServer, start_server
from tests.metrics_load import sample_value, scrape
from tests.models import build_scale

ROOT = Path(__file__).resolve().parent.parent
WARNING = "response_cache.redis has no hmac_key"


def documented_section(doc: Path) -> dict[str, Any]:
    """The first ``response_cache`` YAML block of ``doc``, as a user would copy it."""
    for block in re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.S):
        if block.startswith("response_cache:"):
            section: dict[str, Any] = yaml.safe_load(block)["response_cache"]
            return section
    raise AssertionError(f"{doc}: no response_cache block")


def _post(server: RunningServer, model: str) -> httpx.Response:
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    r = httpx.post(f"{server.base}/v2/models/{model}/infer", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    return r


@pytest.mark.parametrize("doc", ["docs/cache.md", "README.md"])
def test_documented_redis_config_is_warm_after_a_restart(
    doc: str,
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert redis_server.command(b"FLUSHALL") == b"+OK"
    section = documented_section(ROOT / doc)
    section["redis"]["url"] = redis_server.url
    section["redis"]["namespace"] = "restart"
    keyless = {**section, "redis": {k: v for k, v in section["redis"].items() if "hmac" not in k}}
    repo = tmp_path / "repo"
    for name, cache in {"documented": section, "nokey1": keyless, "nokey2": keyless}.items():
        build_scale(repo / name / "1" / "model.onnx", 2.0)
        config = {"max_batch_size": 8, "response_cache": cache}
        (repo / name / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("RTSERVE_CACHE_KEY", "operator-secret-0123456789abcdef")

    first = start_server(repo, tmp_path / "first")
    try:
        assert _post(first, "documented").headers["x-rtserve-cache"] == "miss"
        _post(first, "nokey1")
        deadline = time.monotonic() + 5
        while redis_server.command(b"DBSIZE") != b":2":
            assert time.monotonic() < deadline, "the writes never reached Redis"
            time.sleep(0.02)
        assert first.log().count(WARNING) == 1  # once per process, not once per model
    finally:
        first.stop()

    second = start_server(repo, tmp_path / "second")
    try:
        assert _post(second, "documented").headers["x-rtserve-cache"] == "redis"
        metrics = scrape(second)
        rejected = "rtserve_cache_rejected_values_total"
        assert sample_value(metrics, rejected, model="documented", reason="signature") == 0
        # What the key avoids: a keyless model's values are rejected after the restart.
        assert _post(second, "nokey1").headers["x-rtserve-cache"] == "miss"
        deadline = time.monotonic() + 3  # (the lookup may finish after the answer)
        while sample_value(scrape(second), rejected, model="nokey1", reason="signature") != 1:
            assert time.monotonic() < deadline, "the unsigned value was never rejected"
            time.sleep(0.05)
    finally:
        second.stop()
