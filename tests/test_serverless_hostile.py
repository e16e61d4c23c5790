"""The Lambda handler against hostile events, with keys and a rate limit configured: fields
of odd types, text that is not Unicode, header names and values no HTTP parser would pass,
paths spelled to reach another route than the one checked, ``rawPath`` and
``requestContext.http.path`` disagreeing, a forged ``X-Forwarded-For``. Each is a 4xx naming
the field, never a 500 or a request that reaches a model its key may not use. Then in
fresh processes: a missing ``RTSERVE_MODEL_REPOSITORY`` (Lambda's init fails, naming it; a
handler started later answers 503 saying why), and a generative model's process exits
without a traceback."""

from __future__ import annotations

import base64
import copy
import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.llm_models import build_llm
from tests.models import build_scale

USER = "user-token-0123456789abcdef"  # model a
ADMIN = "admin-token-0123456789abcdef"
BURST = 20
X = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                            "data": [1, 2, 3, 4]}]})  # fmt: skip
EVENT: dict[str, Any] = {
    "version": "2.0",
    "routeKey": "$default",
    "rawPath": "/v2/models/a/infer",
    "rawQueryString": "",
    "headers": {"content-type": "application/json"},
    "requestContext": {
        "http": {"method": "POST", "path": "/v2/models/a/infer", "protocol": "HTTP/1.1",
                 "sourceIp": "192.0.2.1", "userAgent": "test"},
        "requestId": "id",
        "stage": "$default",
    },
    "body": X,
    "isBase64Encoded": False,
}  # fmt: skip
_addresses = (f"198.51.100.{i}" for i in itertools.count(1))


def _event(key: str | None = USER, **changes: Any) -> dict[str, Any]:
    """A function URL event from a new client address (each its own rate limit bucket)."""
    event = copy.deepcopy(EVENT)
    event["requestContext"]["http"]["sourceIp"] = next(_addresses)
    if key is not None:
        event["headers"]["authorization"] = f"Bearer {key}"
    event.update(changes)
    return event


def _repository(root: Path) -> Path:
    for name, k in (("a", 2.0), ("b", 3.0)):
        build_scale(root / name / "1" / "model.onnx", k)
        (root / name / "config.yaml").write_text("max_batch_size: 4\n")
    return root


@pytest.fixture(scope="module")
def serverless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    base = tmp_path_factory.mktemp("hostile-lambda")
    keys = base / "auth.yaml"
    keys.write_text(
        f"keys:\n  - {{name: app, token: {USER}, models: [a]}}\n"
        f"  - {{name: ops, token: {ADMIN}, admin: true}}\n"
    )
    config = base / "server.yaml"
    config.write_text(
        f"auth_file: {keys}\nrate_limit_rps: 1\nrate_limit_burst: {BURST}\n"
        "max_request_bytes: 65536\nhttp_max_headers: 50\nhttp_max_header_bytes: 4096\n"
    )
    import rtserve.serverless as module

    module.shutdown()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(module.ENV_REPOSITORY, str(_repository(base / "repo")))
        env.setenv(module.ENV_CONFIG, str(config))
        try:
            yield module
        finally:
            module.shutdown()


def _call(module: ModuleType, event: Any) -> tuple[int, dict[str, str], Any]:
    out = module.handler(event, None)
    assert set(out) == {"statusCode", "headers", "body", "isBase64Encoded"}
    return out["statusCode"], out["headers"], json.loads(out["body"])


def _refused(module: ModuleType, event: Any, status: int, says: str) -> None:
    got, headers, doc = _call(module, event)
    assert (got, headers["content-type"]) == (status, "application/json"), doc
    assert set(doc) == {"error"} and says in doc["error"], doc


def test_the_plain_event_is_answered(serverless: ModuleType) -> None:
    status, _, doc = _call(serverless, _event())
    assert status == 200 and doc["outputs"][0]["data"] == [2, 4, 6, 8]


HEADERS = [
    ({"x-a": 5}, "event.headers['x-a']: expected a string, got int"),
    ({"x-a": None}, "event.headers['x-a']: expected a string, got NoneType"),
    ({"x-a": ["v"]}, "event.headers['x-a']: expected a string, got list"),
    ({"x-a": {"v": 1}}, "event.headers['x-a']: expected a string, got dict"),
    ({7: "v"}, "event.headers: '7' is not an HTTP header name"),
    ({"bad name": "v"}, "'bad name' is not an HTTP header name"),
    ({"a:b": "v"}, "'a:b' is not an HTTP header name"),
    ({"": "v"}, "'' is not an HTTP header name"),
    ({"x-a": "v\r\nx-injected: 1"}, "a value with CR, LF or NUL characters"),
    ({"x-a": "v\x00"}, "a value with CR, LF or NUL characters"),
    ({"x-a": "\ud800"}, "a value that is not valid Unicode"),
]


@pytest.mark.parametrize(("headers", "says"), HEADERS, ids=range(len(HEADERS)))
def test_header_names_and_values_of_odd_types_are_400s(
    serverless: ModuleType, headers: dict[Any, Any], says: str
) -> None:
    event = _event()
    event["headers"].update(headers)
    _refused(serverless, event, 400, says)


@pytest.mark.parametrize(
    ("multi", "says"),
    [
        ({"x-a": "v"}, "event.multiValueHeaders['x-a']: expected a list of strings"),
        ({"x-a": [1]}, "event.multiValueHeaders['x-a']: expected a list of strings"),
        ({"x a": ["v"]}, "event.multiValueHeaders: 'x a' is not an HTTP header name"),
    ],
)
def test_multi_value_headers_of_odd_types_are_400s(
    serverless: ModuleType, multi: dict[str, Any], says: str
) -> None:
    _refused(serverless, _event(multiValueHeaders=multi), 400, says)


def test_a_credential_given_twice_is_not_the_last_one(serverless: ModuleType) -> None:
    """Two spellings of Authorization in one event (or in headers and multiValueHeaders)
    are joined, as API Gateway joins repeated headers: they match no key."""
    event = _event(key=None)
    event["headers"].update({"Authorization": f"Bearer {ADMIN}", "authorization": f"Bearer {USER}"})
    _refused(serverless, event, 401, "invalid credentials")
    event = _event(key=None, version="1.0", httpMethod="POST", path="/v2/models/a/infer")
    event["multiValueHeaders"] = {"Authorization": [f"Bearer {USER}", f"Bearer {ADMIN}"]}
    _refused(serverless, event, 401, "invalid credentials")


def test_text_that_is_not_unicode_is_a_400(serverless: ModuleType) -> None:
    _refused(serverless, _event(body='{"a": "\ud800"}'), 400, "event.body: not valid Unicode")
    _refused(serverless, _event(rawPath="/v2/models/\udcff/infer"), 400, "not valid Unicode")


GARBAGE: list[Any] = [
    [],
    "GET /v2",
    None,
    7,
    {"version": "2.0"},
    {"version": "2.0", "rawPath": "/v2", "requestContext": []},
    {"version": "2.0", "rawPath": "/v2", "requestContext": {"http": {"method": 5}}},
    {"version": "2.0", "rawPath": 5, "requestContext": {"http": {"method": "GET"}}},
    {"httpMethod": "GET", "path": None},
    {"httpMethod": "G" * 100_000, "path": "/v2"},
    {"httpMethod": "GET", "path": "v2/health/live"},
]


@pytest.mark.parametrize("event", GARBAGE, ids=range(len(GARBAGE)))
def test_events_that_are_not_http_requests_are_400s(serverless: ModuleType, event: Any) -> None:
    assert _call(serverless, event)[0] == 400


def test_garbage_fields_are_named(serverless: ModuleType) -> None:
    _refused(serverless, _event(body={"inputs": []}), 400, "event.body: expected a string")
    _refused(serverless, _event(isBase64Encoded="yes"), 400, "event.isBase64Encoded")
    _refused(serverless, _event(isBase64Encoded=True, body="%%%"), 400, "not base64")
    _refused(serverless, _event(headers=["authorization"]), 400, "event.headers: expected")
    event = _event()
    event["requestContext"]["stage"] = ["prod"]  # (a stage that is not text: no prefix)
    assert _call(serverless, event)[0] == 200


def test_huge_bodies_are_refused_before_they_are_decoded(serverless: ModuleType) -> None:
    huge = "é" * 5_000_000  # 10 MB once encoded
    start = time.perf_counter()
    _refused(serverless, _event(body=huge), 413, "exceeds the limit of 65536 bytes")
    b64 = base64.b64encode(b"x" * 8_000_000).decode()
    _refused(serverless, _event(body=b64, isBase64Encoded=True), 413, "max_request_bytes")
    assert time.perf_counter() - start < 1.0
    # At the limit, and one byte past it (base64's padding counted exactly).
    at = base64.b64encode(b" " * 65536).decode()
    _refused(serverless, _event(body=at, isBase64Encoded=True), 400, "JSON")
    past = base64.b64encode(b" " * 65537).decode()
    _refused(serverless, _event(body=past, isBase64Encoded=True), 413, "65537 bytes")


def test_header_limits_as_the_server_applies_them(serverless: ModuleType) -> None:
    event = _event()
    event["headers"].update({f"x-{i}": "v" for i in range(60)})
    _refused(serverless, event, 431, "more than 50 request headers (http_max_headers)")
    event = _event()
    event["headers"]["x-long"] = "v" * 5000
    _refused(serverless, event, 431, "per header (http_max_header_bytes)")
    _refused(serverless, _event(rawPath="/v2/" + "a" * 9000), 414, "http_max_url_bytes")
    _refused(serverless, _event(rawQueryString="q=" + "a" * 9000), 414, "http_max_url_bytes")


PATHS = [
    ("/v2/models/a/../b/infer", 400, "'..' segments"),
    ("/v2/models/a/%2e%2e/b/infer", 400, "'..' segments"),
    ("/v2/models/a%2Fb/infer", 400, "encoded"),
    ("/v2/models/%62/infer", 403, "may not use model 'b'"),  # the guard sees the decoded name
    ("/v2//models/b/infer", 403, "may not use model 'b'"),
    ("/v2/models/b/./infer", 400, "'.' and '..' segments"),
]


@pytest.mark.parametrize(("path", "status", "says"), PATHS, ids=range(len(PATHS)))
def test_paths_spelled_otherwise_reach_no_other_model(
    serverless: ModuleType, path: str, status: int, says: str
) -> None:
    event = _event(rawPath=path)
    event["requestContext"]["http"]["path"] = path
    _refused(serverless, event, status, says)


def test_percent_encoding_of_the_allowed_model_is_served(serverless: ModuleType) -> None:
    assert _call(serverless, _event(rawPath="/v2/models/%61/infer"))[0] == 200


def test_raw_path_decides_for_the_guard_and_the_router_alike(serverless: ModuleType) -> None:
    """``requestContext.http.path`` (and a 1.0 event's ``requestContext.path``) may say
    otherwise: the handler reads one path for both the key check and the route."""
    event = _event(rawPath="/v2/models/b/infer")
    event["requestContext"]["http"]["path"] = "/v2/models/a/infer"
    _refused(serverless, event, 403, "may not use model 'b'")
    event = _event(key=None, rawPath="/v2/health/live", body=None)
    event["requestContext"]["http"].update(path="/metrics", method="GET")
    assert _call(serverless, event)[:3:2] == (200, {"live": True})
    event = _event(key=None, rawPath="/metrics", body=None)
    event["requestContext"]["http"].update(path="/v2/health/live", method="GET")
    _refused(serverless, event, 401, "missing credentials")
    v1 = _event(version="1.0", httpMethod="POST", path="/v2/models/b/infer")
    v1["requestContext"] = {"path": "/prod/v2/models/a/infer", "stage": "prod",
                            "identity": {"sourceIp": "192.0.2.200"}}  # fmt: skip
    _refused(serverless, v1, 403, "may not use model 'b'")


def test_the_rate_limit_keys_on_the_source_address_not_forwarded_for(
    serverless: ModuleType,
) -> None:
    statuses = []
    for i in range(BURST + 10):
        event = _event(rawPath="/v2/models/a/ready", body=None)
        event["requestContext"]["http"].update(method="GET", sourceIp="203.0.113.9")
        event["headers"]["x-forwarded-for"] = f"10.0.0.{i}"
        statuses.append(_call(serverless, event)[0])
        if statuses[-1] == 429:
            break
    assert statuses[-1] == 429 and statuses.count(200) >= BURST - 1, statuses
    v1 = _event(version="1.0", httpMethod="GET", path="/v2/models/a/ready", body=None)
    v1["requestContext"] = {"identity": {"sourceIp": "203.0.113.9"}}
    _refused(serverless, v1, 429, "rate limit")  # (1.0 events: the same address, the same bucket)


# ---------------------------------------------------------------------- fresh processes
def _python(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RTSERVE_", "AWS_"))}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT / "src"), **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_without_a_repository_lambdas_init_fails_naming_it() -> None:
    done = _python("import rtserve.serverless", {"AWS_LAMBDA_FUNCTION_NAME": "fn"})
    assert done.returncode != 0
    assert "ConfigError: RTSERVE_MODEL_REPOSITORY: not set" in done.stderr


def test_a_handler_started_without_a_repository_answers_503_saying_why() -> None:
    script = f"""
        import json
        import rtserve.serverless as s
        print(json.dumps(s.handler({EVENT!r}, None)))
    """
    done = _python(script, {})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["statusCode"] == 503
    assert "RTSERVE_MODEL_REPOSITORY: not set" in json.loads(out["body"])["error"]
    assert "RTSERVE_MODEL_REPOSITORY: not set" in done.stderr  # (and in the log)


def test_a_generative_model_exits_without_a_traceback(tmp_path: Path) -> None:
    """Lambda ends the process after the last invocation: the engine stops at exit, before
    the interpreter's executors are gone (it used to raise "cannot schedule new futures
    after shutdown" from the llm engine's stop)."""
    build_llm(tmp_path / "repo", "tiny")
    event = copy.deepcopy(EVENT)
    event.update(
        rawPath="/v1/completions",
        body=json.dumps({"model": "tiny", "prompt": "the cat", "max_tokens": 3}),
    )
    script = f"""
        import rtserve.serverless as s
        print(s.handler({event!r}, None)["statusCode"])
    """
    done = _python(script, {"RTSERVE_MODEL_REPOSITORY": str(tmp_path / "repo")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "200"
    assert "Traceback" not in done.stderr and "cannot schedule" not in done.stderr, done.stderr
