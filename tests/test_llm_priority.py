"""A generation's ``priority`` is a privilege: bounded, and granted per key (or by the
model's config); the preemption counter counts. Real servers (one with keys, one without)
over tiny random-weight models, plain HTTP clients."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from rtserve.errors import ConfigError
from rtserve.server.security import Auth
from tests.conftest import RunningServer, start_server

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.llm_models import build_llm  # noqa: E402

PLAIN_KEY = "plain-key-0123456789abcdef"
URGENT_KEY = "urgent-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("priority-repo")
    build_llm(root, "tiny")
    build_llm(root, "lenient", llm={"min_priority": -10})
    work = tmp_path_factory.mktemp("priority")
    auth = work / "auth.yaml"
    keys = [
        {"name": "plain", "token": PLAIN_KEY, "models": "*"},
        {"name": "urgent", "token": URGENT_KEY, "models": "*", "min_priority": -50},
        {"name": "admin", "token": ADMIN_KEY, "models": "*", "admin": True},
    ]
    auth.write_text(yaml.safe_dump({"keys": keys}))
    server = start_server(root, work, "--auth-file", str(auth))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("priority-open-repo")
    build_llm(root, "tiny")
    # 32 blocks of 4 tokens: a dozen answers of ~60 tokens preempt each other.
    build_llm(root, "cramped", llm={"block_size": 4, "kv_cache_bytes": 1 << 16})
    server = start_server(root, tmp_path_factory.mktemp("priority-open"))
    yield server
    server.stop()


def complete(
    server: RunningServer, priority: object, key: str = "", model: str = "tiny"
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "the cat sat", "max_tokens": 2, "priority": priority}
    return httpx.post(f"{server.base}/v1/completions", json=body, headers=headers, timeout=30)


def refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == "priority" and words in error["message"], error


def test_priority_outside_its_range_is_a_400(keyed: RunningServer) -> None:
    for bad in (-(2**63), 2**63 - 1, 101, -101):
        refused(complete(keyed, bad, URGENT_KEY), 400, "expected an integer in [-100, 100]")
    for bad in ("high", 1.5, 2**70, True):  # (2**70: a float to JSON parsers)
        refused(complete(keyed, bad, URGENT_KEY), 400, "expected an integer")


def test_a_key_may_ask_only_the_urgency_it_is_granted(keyed: RunningServer) -> None:
    # plain: no grant, the model's floor (0: it may only lower its own urgency).
    assert complete(keyed, 0, PLAIN_KEY).status_code == 200
    assert complete(keyed, 100, PLAIN_KEY).status_code == 200
    answer = complete(keyed, -1, PLAIN_KEY)
    refused(answer, 403, "expected at least 0")
    assert answer.json()["error"]["type"] == "permission_error"
    # the model "lenient" allows down to -10 without a grant.
    assert complete(keyed, -10, PLAIN_KEY, "lenient").status_code == 200
    refused(complete(keyed, -11, PLAIN_KEY, "lenient"), 403, "expected at least -10")
    # urgent: granted down to -50, at any model.
    assert complete(keyed, -50, URGENT_KEY).status_code == 200
    assert complete(keyed, -50, URGENT_KEY, "lenient").status_code == 200
    refused(complete(keyed, -51, URGENT_KEY), 403, "more urgency than this key is granted")


def test_without_keys_a_request_may_only_lower_its_urgency(keyless: RunningServer) -> None:
    for ok in (0, 7, 100):
        assert complete(keyless, ok).status_code == 200
    refused(complete(keyless, -1), 403, "more urgency than the model allows")
    refused(complete(keyless, -(2**63)), 400, "[-100, 100]")


def test_a_bad_min_priority_in_the_auth_file_names_the_key(tmp_path: Path) -> None:
    auth = tmp_path / "auth.yaml"
    for bad in (-101, "high", True):
        keys = [{"name": "k", "token": PLAIN_KEY}, {"token": URGENT_KEY, "min_priority": bad}]
        auth.write_text(yaml.safe_dump({"keys": keys}))
        with pytest.raises(ConfigError, match=r"keys\[1\]\.min_priority: expected an integer"):
            Auth.from_file(auth)
    keys = [{"name": "k", "token": PLAIN_KEY, "min_priority": -5}]
    auth.write_text(yaml.safe_dump({"keys": keys}))
    assert Auth.from_file(auth).grants[0].min_priority == -5


def _counter(server: RunningServer, name: str, model: str) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {model} not in /metrics")


def test_preemptions_are_counted_on_metrics(keyless: RunningServer) -> None:
    assert _counter(keyless, "rtserve_llm_preemptions_total", "cramped") == 0
    body = {"model": "cramped", "prompt": "the cat sat on the mat", "max_tokens": 60}
    body["ignore_eos"] = True

    def one(_: int) -> int:
        url = f"{keyless.base}/v1/completions"
        answer = httpx.post(url, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return int(answer.json()["usage"]["completion_tokens"])

    with ThreadPoolExecutor(12) as pool:
        assert list(pool.map(one, range(12))) == [60] * 12
    assert _counter(keyless, "rtserve_llm_preemptions_total", "cramped") > 0
    assert _counter(keyless, "rtserve_llm_kv_blocks_used", "cramped") == 0
