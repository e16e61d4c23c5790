"""The Lambda handler (``rtserve.serverless``) called with the events API Gateway (REST,
payload 1.0; HTTP API, payload 2.0) and function URLs send, as Lambda's runtime calls it;
a tiny generative model on the OpenAI routes through the official client (its requests as
function URL events); then in fresh processes: one load per process, no ``awslambdaric``,
SnapStart hooks."""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as thttp

from tests.cache_fixtures import RedisServer
from tests.conftest import ROOT
from tests.llm_models import build_llm
from tests.models import build_scale

MAX_REQUEST_BYTES = 65536

# Recorded event shapes (AWS documentation examples, trimmed of fields rtserve ignores).
REST_V1: dict[str, Any] = {
    "version": "1.0",
    "resource": "/{proxy+}",
    "path": "/v2/models/scale/infer",
    "httpMethod": "POST",
    "headers": {"Content-Type": "application/json", "X-Request-Id": "req-1"},
    "multiValueHeaders": {
        "Content-Type": ["application/json"],
        "X-Request-Id": ["req-1"],
    },
    "queryStringParameters": None,
    "multiValueQueryStringParameters": None,
    "requestContext": {
        "accountId": "123456789012",
        "apiId": "id",
        "httpMethod": "POST",
        "path": "/prod/v2/models/scale/infer",
        "stage": "prod",
        "requestId": "id",
        "resourcePath": "/{proxy+}",
    },
    "pathParameters": {"proxy": "v2/models/scale/infer"},
    "stageVariables": None,
    "body": None,
    "isBase64Encoded": False,
}
HTTP_V2: dict[str, Any] = {
    "version": "2.0",
    "routeKey": "ANY /{proxy+}",
    "rawPath": "/prod/v2/models/scale/infer",
    "rawQueryString": "",
    "headers": {"content-type": "application/json", "x-request-id": "req-2"},
    "requestContext": {
        "accountId": "123456789012",
        "apiId": "api-id",
        "domainName": "id.execute-api.us-east-1.amazonaws.com",
        "http": {
            "method": "POST",
            "path": "/prod/v2/models/scale/infer",
            "protocol": "HTTP/1.1",
            "sourceIp": "192.0.2.1",
            "userAgent": "agent",
        },
        "requestId": "id",
        "routeKey": "ANY /{proxy+}",
        "stage": "prod",
        "timeEpoch": 1583348638390,
    },
    "pathParameters": {"proxy": "v2/models/scale/infer"},
    "body": None,
    "isBase64Encoded": False,
}
FUNCTION_URL: dict[str, Any] = {
    "version": "2.0",
    "routeKey": "$default",
    "rawPath": "/v2/models/scale/infer",
    "rawQueryString": "",
    "headers": {"content-type": "application/json", "host": "abc.lambda-url.us-east-1.on.aws"},
    "requestContext": {
        "accountId": "anonymous",
        "apiId": "abc",
        "domainName": "abc.lambda-url.us-east-1.on.aws",
        "domainPrefix": "abc",
        "http": {
            "method": "POST",
            "path": "/v2/models/scale/infer",
            "protocol": "HTTP/1.1",
            "sourceIp": "192.0.2.1",
            "userAgent": "agent",
        },
        "requestId": "id",
        "routeKey": "$default",
        "stage": "$default",
        "time": "12/Mar/2020:19:03:58 +0000",
        "timeEpoch": 1583348638390,
    },
    "body": None,
    "isBase64Encoded": False,
}
ROWS = [[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 0.0, 8.0]]
V2_BODY = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": ROWS}]})


def _event(shape: dict[str, Any], body: str | None = None, **changes: Any) -> dict[str, Any]:
    event = copy.deepcopy(shape)
    event["body"] = body
    event.update(changes)
    return event


def _get(path: str) -> dict[str, Any]:
    """A payload 2.0 GET (HTTP API, $default stage)."""
    event = _event(FUNCTION_URL, rawPath=path)
    event["requestContext"]["http"]["method"] = "GET"
    return event


def _repository(root: Path) -> Path:
    build_scale(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text(
        "max_batch_size: 8\ndynamic_batching: {max_queue_delay_us: 500}\n"
    )
    return root


@pytest.fixture(scope="module")
def serverless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """The handler module with a repository and a server config (a 64 KiB body limit),
    from the environment as Lambda sets them."""
    root = _repository(tmp_path_factory.mktemp("lambda-repo"))
    shutil.copytree(ROOT / "examples" / "repository" / "digits", root / "digits")
    build_llm(root, LLM)
    config = tmp_path_factory.mktemp("lambda-config") / "server.yaml"
    config.write_text(f"max_request_bytes: {MAX_REQUEST_BYTES}\n")
    os.environ["RTSERVE_MODEL_REPOSITORY"] = str(root)
    os.environ["RTSERVE_CONFIG"] = str(config)
    import rtserve.serverless as module

    try:
        yield module
    finally:
        module.shutdown()
        del os.environ["RTSERVE_MODEL_REPOSITORY"], os.environ["RTSERVE_CONFIG"]


def _call(serverless: ModuleType, event: Any) -> tuple[int, dict[str, str], Any]:
    """Invoke as Lambda does; the answer must be what API Gateway accepts."""
    out = serverless.handler(event, None)
    assert set(out) == {"statusCode", "headers", "body", "isBase64Encoded"}
    assert isinstance(out["body"], str) and out["isBase64Encoded"] is False
    return out["statusCode"], out["headers"], json.loads(out["body"])


def _doubled(doc: dict[str, Any]) -> None:
    (out,) = doc["outputs"]
    assert out["name"] == "y" and out["shape"] == [2, 4]
    np.testing.assert_allclose(np.array(out["data"]).reshape(2, 4), 2 * np.array(ROWS))


@pytest.mark.parametrize("shape", [REST_V1, HTTP_V2, FUNCTION_URL], ids=["v1", "v2", "url"])
def test_each_event_shape_infers(serverless: ModuleType, shape: dict[str, Any]) -> None:
    status, headers, doc = _call(serverless, _event(shape, V2_BODY))
    assert status == 200 and headers["content-type"] == "application/json"
    assert doc["model_name"] == "scale"
    _doubled(doc)
    if "x-request-id" in shape["headers"] or "X-Request-Id" in shape["headers"]:
        assert headers["x-request-id"] in ("req-1", "req-2")


def test_a_forked_child_starts_its_own_engine(serverless: ModuleType) -> None:
    """A pre-fork worker: the parent's engine thread is not in the child, which waited for
    ever on it; the child now loads its own."""
    import signal

    body = json.dumps({"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32",
                                   "data": ROWS}]})  # fmt: skip
    event = _event(HTTP_V2, body)
    assert _call(serverless, event)[0] == 200
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # (a hang ends the child, not the test run)
        try:
            status = serverless.handler(event, None)["statusCode"]
            os.write(write, str(status).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    answer = os.read(read, 16)
    os.close(read)
    assert answer == b"200"
    assert _call(serverless, event)[0] == 200


def test_base64_json_body(serverless: ModuleType) -> None:
    body = base64.b64encode(V2_BODY.encode()).decode()
    status, _, doc = _call(serverless, _event(HTTP_V2, body, isBase64Encoded=True))
    assert status == 200
    _doubled(doc)


def test_binary_tensors_round_trip_base64(serverless: ModuleType) -> None:
    """tritonclient's binary data extension: in and out as base64 bodies."""
    x = thttp.InferInput("x", [2, 4], "FP32")
    x.set_data_from_numpy(np.array(ROWS, np.float32), binary_data=True)
    body, json_size = thttp.InferenceServerClient.generate_request_body(
        [x], [thttp.InferRequestedOutput("y", binary_data=True)]
    )
    event = _event(FUNCTION_URL, base64.b64encode(body).decode(), isBase64Encoded=True)
    event["headers"]["inference-header-content-length"] = str(json_size)
    out = serverless.handler(event, None)
    assert out["statusCode"] == 200 and out["isBase64Encoded"] is True
    headers = out["headers"]
    assert headers["content-type"] == "application/octet-stream"
    result = thttp.InferenceServerClient.parse_response_body(
        base64.b64decode(out["body"]),
        header_length=int(headers["inference-header-content-length"]),
    )
    np.testing.assert_allclose(result.as_numpy("y"), 2 * np.array(ROWS, np.float32))


@pytest.mark.parametrize(
    ("event_changes", "status", "says"),
    [
        ({"body": "{not json"}, 400, "not valid JSON"),
        ({"body": "%%%", "isBase64Encoded": True}, 400, "not base64"),
        ({"rawPath": "/v2/models/nope/infer", "body": V2_BODY}, 404, "unknown model 'nope'"),
        ({"rawPath": "/v2/models/scale/../x/infer", "body": V2_BODY}, 400, "'..' segments"),
        (
            {"rawPath": "/v2/models/scale/infer", "body": "x" * (MAX_REQUEST_BYTES + 1)},
            413,
            "65536",
        ),
        ({"rawPath": "/v2/repository/models/scale/unload", "body": ""}, 404, "model control"),
        ({"headers": [["a", "b"]]}, 400, "event.headers: expected an object"),
        ({"headers": {"x-\u00e9\u20ac": "1"}}, 400, "is not an HTTP header name"),
        ({"requestContext": {"http": "POST"}}, 400, "with an HTTP method and path"),
        ({"requestContext": {"http": {"method": "P\u00d6ST"}}}, 400, "HTTP method and path"),
        ({"body": "{}", "isBase64Encoded": "maybe"}, 400, "isBase64Encoded: expected true"),
    ],
    ids=[
        "bad-json",
        "bad-base64",
        "unknown-model",
        "dot-segment",
        "too-large",
        "control",
        "header-list",
        "header-name",
        "http-not-object",
        "method-not-ascii",
        "base64-flag",
    ],
)
def test_errors_are_answers_in_the_v2_shape(
    serverless: ModuleType, event_changes: dict[str, Any], status: int, says: str
) -> None:
    event = _event(FUNCTION_URL, **event_changes)
    got, headers, doc = _call(serverless, event)
    assert got == status and headers["content-type"] == "application/json"
    assert set(doc) == {"error"} and says in doc["error"]


def test_the_recipes_example_event(serverless: ModuleType) -> None:
    """deploy/lambda/event-infer.json, as the README invokes it, against examples' digits."""
    event = json.loads((ROOT / "deploy" / "lambda" / "event-infer.json").read_text())
    status, _, doc = _call(serverless, event)
    assert status == 200 and [o["name"] for o in doc["outputs"]] == ["label"]


def test_not_an_http_event_is_a_400_not_an_exception(serverless: ModuleType) -> None:
    assert _call(serverless, {"hello": "world"})[0] == 400
    assert _call(serverless, ["not", "an", "object"])[0] == 400


def test_health_metadata_and_config_routes(serverless: ModuleType) -> None:
    assert _call(serverless, _get("/v2/health/live"))[2] == {"live": True}
    assert _call(serverless, _get("/v2/health/ready"))[:3:2] == (200, {"ready": True})
    assert _call(serverless, _get("/v2"))[2]["name"] == "rtserve"
    status, _, meta = _call(serverless, _get("/v2/models/%73cale"))  # decoded as the server does
    assert status == 200 and meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    status, _, config = _call(serverless, _get("/v2//models/scale/config"))
    assert status == 200 and config["max_batch_size"] == 8
    v1 = _event(REST_V1, httpMethod="GET", path="/v2/models/scale/ready")
    assert _call(serverless, v1)[:3:2] == (200, {"name": "scale", "ready": True})
    assert _call(serverless, _get("/v2/nothing"))[0] == 404
    head = _get("/v2/health/ready")
    head["requestContext"]["http"]["method"] = "HEAD"
    out = serverless.handler(head, None)
    assert out["statusCode"] == 200 and out["body"] == ""  # HEAD: no body


# ---------------------------------------------------------------------- generative models
LLM = "tiny"
CHAT = [{"role": "user", "content": "Write a short story about a cat."}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 10, "extra_body": {"ignore_eos": True}}


class FunctionUrl(httpx.BaseTransport):
    """What a Lambda function URL does: each request to the handler as a payload 2.0
    event, its answer back as the HTTP response."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        event = _event(FUNCTION_URL, request.read().decode() or None, rawPath=request.url.path)
        event["requestContext"]["http"]["method"] = request.method
        event["headers"] = dict(request.headers)
        out = self.module.handler(event, None)
        body = out["body"].encode()
        content = base64.b64decode(body) if out["isBase64Encoded"] else body
        return httpx.Response(out["statusCode"], headers=out["headers"], content=content)


def _client(module: ModuleType) -> openai.OpenAI:
    http = httpx.Client(transport=FunctionUrl(module))
    return openai.OpenAI(
        base_url="https://fn.lambda-url.example/v1", api_key="unused", http_client=http
    )


def test_openai_client_through_the_handler(serverless: ModuleType) -> None:
    """Chat and completions, whole and streamed (the events arrive in one body), give the
    same greedy text; a completion equals Triton's generate on the same prompt."""
    client = _client(serverless)
    whole = client.chat.completions.create(model=LLM, messages=CHAT, **GREEDY)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=LLM, messages=CHAT, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    completion = client.completions.create(model=LLM, prompt="the cat sat", **GREEDY)
    assert [m.id for m in client.models.list().data] == [LLM]
    doc = {"text_input": "the cat sat", "parameters": {"max_tokens": 10, "temperature": 0,
           "ignore_eos": True}}  # fmt: skip
    event = _event(FUNCTION_URL, json.dumps(doc), rawPath=f"/v2/models/{LLM}/generate")
    status, _, generated = _call(serverless, event)
    assert status == 200 and generated["text_output"] == completion.choices[0].text


def test_openai_errors_through_the_handler(serverless: ModuleType) -> None:
    client = _client(serverless)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=LLM, messages=CHAT, max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="nope", prompt="a")
    assert unknown.value.code == "model_not_found"
    event = _event(FUNCTION_URL, "{nope", rawPath="/v1/chat/completions")
    status, headers, doc = _call(serverless, event)
    assert status == 400 and headers["content-type"] == "application/json"
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["type"] == "invalid_request_error" and "JSON" in doc["error"]["message"]


# ---------------------------------------------------------------------- fresh processes
def _run(
    script: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_models_load_once_per_process_and_awslambdaric_is_not_needed(tmp_path: Path) -> None:
    """As Lambda runs it: import (init), then two invocations. The model is loaded and
    warmed once, at import; the second invocation costs inference only."""
    root = _repository(tmp_path / "repo")
    script = f"""
        import json, logging, sys, time
        sys.modules["awslambdaric"] = None  # importing it would fail
        logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
        t0 = time.perf_counter()
        import rtserve.serverless as s
        t1 = time.perf_counter()
        event = {_event(FUNCTION_URL, V2_BODY)!r}
        times = []
        for _ in range(2):
            start = time.perf_counter()
            out = s.handler(event, None)
            times.append(time.perf_counter() - start)
            assert out["statusCode"] == 200, out
        print(json.dumps({{"init": t1 - t0, "invocations": times}}))
    """
    done = _run(script, {"RTSERVE_MODEL_REPOSITORY": str(root)})
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("LOG model scale ready") == 1, done.stderr
    timing = json.loads(done.stdout.strip().splitlines()[-1])
    assert timing["invocations"][1] < 0.05 < timing["init"], timing


SNAPSHOT_SCRIPT = """
    import json, numpy as np, redis, snapshot_restore_py as snap
    import rtserve.serverless as s

    def clients():
        return redis.Redis(port={port}).info("clients")["connected_clients"] - 1

    event = {event}
    assert s.handler(event, None)["statusCode"] == 200  # a miss: read and write Redis
    s.engine().run(s.engine().engine.registry.get("cached").cache.redis.flush())
    before = clients()
    for hook, args, kwargs in snap.get_before_snapshot():
        hook(*args, **kwargs)
    during = clients()
    np.random.seed(7)
    snapshotted = np.random.random()
    np.random.seed(7)
    for hook, args, kwargs in snap.get_after_restore():
        hook(*args, **kwargs)
    restored = np.random.random()
    out = s.handler(event, None)  # a hit from Redis through a new connection
    print(json.dumps({{"before": before, "during": during, "fresh_rng": restored != snapshotted,
                      "status": out["statusCode"], "cache": out["headers"].get("x-rtserve-cache")}}))
"""


def test_snapstart_hooks_close_connections_and_reseed(tmp_path: Path, redis: RedisServer) -> None:
    """With ``snapshot_restore_py`` present, the hooks the runtime calls around a snapshot:
    before it, no Redis connection stays open; after a restore, fresh random state, and the
    cache's Redis tier reconnects."""
    root = tmp_path / "repo"
    build_scale(root / "cached" / "1" / "model.onnx", 2.0)
    (root / "cached" / "config.yaml").write_text(
        f"max_batch_size: 8\nresponse_cache: {{redis: {{url: '{redis.url}', ttl_s: 60}}}}\n"
    )
    event = _event(FUNCTION_URL, V2_BODY, rawPath="/v2/models/cached/infer")
    script = SNAPSHOT_SCRIPT.format(port=redis.port, event=repr(event))
    done = _run(script, {"RTSERVE_MODEL_REPOSITORY": str(root)})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"before": 1, "during": 0, "fresh_rng": True, "status": 200, "cache": "redis"}


def test_cold_start_command_times_each_phase(tmp_path: Path) -> None:
    """``rtserve cold-start``: one fresh process, every phase timed and the total their sum."""
    root = _repository(tmp_path / "repo")
    done = subprocess.run(
        [sys.executable, "-m", "rtserve.cli", "cold-start", str(root), "--runs", "1", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert (row["model"], row["backend"]) == ("scale", "onnxruntime")
    phases = [row[k] for k in ("start", "import", "backend_import", "load", "warmup")]
    assert all(p >= 0 for p in phases) and row["import"] > 0 and row["first_answer"] > 0
    assert row["total"] == pytest.approx(sum(phases) + row["first_answer"], abs=1.0)
