"""Every entry applies the same keys and limits: ``rtserve serve`` over HTTP, the Lambda
handler (``rtserve.serverless.handler`` called in-process with function URL events), and
the Ray deployment (a local Ray, its proxy on 127.0.0.1), all given one server config
(``auth_file``, a rate limit, small body, JSON and header limits). Each is asked the same
requests; each must answer the same statuses with the same error shape: no key 401, another
model's key 403, the right key 200, admin routes the admin key, 429 with Retry-After past
the rate limit (per client address), 413 past a body limit, 431 past a header limit. A
setting an adapter cannot honour (TLS, shared memory) stops its start, naming it."""

from __future__ import annotations

import base64
import gzip
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tests.conftest import ROOT, start_server
from tests.llm_models import build_llm
from tests.models import build_scale
from tests.ray_serve_entry import ray_serve_base

USER = "user-token-0123456789abcdef"  # model a
LLM_USER = "llm-token-0123456789abcdef"  # model tiny
ADMIN = "admin-token-0123456789abcdef"  # every model, the admin routes
LLM = "tiny"
MAX_BODY = 65536
MAX_INFLATED = 200_000
MAX_CONTAINERS = 500
BURST = 40
X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
Answer = tuple[int, dict[str, str], bytes]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A repository (a, b: tensor models; tiny: a generative one) and the server config
    every entry is given."""
    base = tmp_path_factory.mktemp("entries")
    repo = base / "repo"
    for name, k in (("a", 2.0), ("b", 3.0)):
        build_scale(repo / name / "1" / "model.onnx", k)
        (repo / name / "config.yaml").write_text("max_batch_size: 4\n")
    build_llm(repo, LLM)
    keys = base / "auth.yaml"
    keys.write_text(
        "keys:\n"
        f"  - {{name: app, token: {USER}, models: [a]}}\n"
        f"  - {{name: chat, token: {LLM_USER}, models: [{LLM}]}}\n"
        f"  - {{name: ops, token: {ADMIN}, admin: true}}\n"
    )
    config = base / "server.yaml"
    config.write_text(
        f"auth_file: {keys}\n"
        f"rate_limit_rps: 1\nrate_limit_burst: {BURST}\n"
        f"max_request_bytes: {MAX_BODY}\nmax_decompressed_bytes: {MAX_INFLATED}\n"
        f"max_json_containers: {MAX_CONTAINERS}\n"
        "http_max_headers: 50\nhttp_max_header_bytes: 4096\n"
    )
    return repo, config


# ---------------------------------------------------------------------- the entries
@dataclass
class Entry:
    """One way in; ``call`` sends a request from the client address ``source``."""

    name: str
    base: str = ""
    module: ModuleType | None = None
    clients: dict[str, httpx.Client] = field(default_factory=dict)

    def call(
        self,
        method: str,
        path: str,
        *,
        key: str | None = None,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        source: str = "127.0.0.2",
    ) -> Answer:
        sent = dict(headers or {})
        if key is not None:
            sent["authorization"] = f"Bearer {key}"
        if body is not None and "content-type" not in sent:
            sent["content-type"] = "application/json"
        if self.module is not None:
            return self._invoke(method, path, sent, body, source)
        client = self.clients.get(source)
        if client is None:
            transport = httpx.HTTPTransport(local_address=source)
            client = self.clients[source] = httpx.Client(transport=transport, timeout=60)
        r = client.request(method, self.base + path, content=body, headers=sent)
        return r.status_code, dict(r.headers), r.content

    def _invoke(
        self, method: str, path: str, headers: dict[str, str], body: bytes | None, source: str
    ) -> Answer:
        """As a Lambda function URL calls the handler (a payload 2.0 event)."""
        text, encoded = None, False
        if body is not None:
            try:
                text = body.decode()
            except UnicodeDecodeError:
                text, encoded = base64.b64encode(body).decode(), True
        event = {
            "version": "2.0",
            "routeKey": "$default",
            "rawPath": path,
            "rawQueryString": "",
            "headers": headers,
            "requestContext": {
                "http": {"method": method, "path": path, "protocol": "HTTP/1.1",
                         "sourceIp": source, "userAgent": "test"},
                "requestId": "id",
                "stage": "$default",
            },
            "body": text,
            "isBase64Encoded": encoded,
        }  # fmt: skip
        assert self.module is not None
        out = self.module.handler(event, None)
        raw = out["body"].encode()
        content = base64.b64decode(raw) if out["isBase64Encoded"] else raw
        return out["statusCode"], out["headers"], content


def _serve(repo: Path, config: Path, workdir: Path) -> Iterator[Entry]:
    server = start_server(repo, workdir, "--config", str(config), timeout=300)
    try:
        yield Entry("serve", base=server.base)
    finally:
        server.stop()


def _lambda(repo: Path, config: Path) -> Iterator[Entry]:
    import rtserve.serverless as module

    module.shutdown()  # (another test module's runtime, if any)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(module.ENV_REPOSITORY, str(repo))
        env.setenv(module.ENV_CONFIG, str(config))
        try:
            yield Entry("lambda", module=module)
        finally:
            module.shutdown()


def _ray(repo: Path, config: Path) -> Iterator[Entry]:
    with ray_serve_base(repo, config) as base:
        yield Entry("ray", base=base)


@pytest.fixture(scope="module", params=["serve", "lambda", "ray"])
def entry(
    request: pytest.FixtureRequest,
    setup: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Entry]:
    repo, config = setup
    if request.param == "serve":
        entries = _serve(repo, config, tmp_path_factory.mktemp("serve"))
    elif request.param == "lambda":
        entries = _lambda(repo, config)
    else:
        entries = _ray(repo, config)
    e = next(entries)
    try:
        yield e
    finally:
        for client in e.clients.values():
            client.close()
        next(entries, None)


# ---------------------------------------------------------------------- checks
def _error(answer: Answer, status: int, says: str, v1: bool = False) -> None:
    """``answer`` is a refusal with ``status``, in V2's error shape (OpenAI's on /v1), whose
    message contains ``says``."""
    got, headers, body = answer
    assert got == status, (status, says, answer)
    assert headers["content-type"].startswith("application/json")
    doc = json.loads(body)
    if v1:
        assert set(doc) == {"error"}
        assert set(doc["error"]) == {"message", "type", "param", "code"}
        assert says in doc["error"]["message"], doc
    else:
        assert set(doc) == {"error"} and says in doc["error"], doc


MISSING = "missing credentials"
FORBIDDEN_A = "this key may not use model 'a'"
ADMIN_ONLY = "this route needs an admin key"
INFER_A = ("POST", "/v2/models/a/infer", json.dumps(X).encode())
# (method, path, body) of routes that need a key: inference, metrics, the repository index,
# statistics of every model / of one, metadata, server metadata, model control.
GUARDED = [
    INFER_A,
    ("GET", "/metrics", None),
    ("POST", "/v2/repository/index", b"{}"),
    ("GET", "/v2/models/stats", None),
    ("GET", "/v2/models/a/stats", None),
    ("GET", "/v2/models/a", None),
    ("GET", "/v2/models/a/config", None),
    ("GET", "/v2", None),
    ("POST", "/v2/repository/models/a/unload", b""),
]


def test_no_key_is_401_on_every_route_but_health(entry: Entry) -> None:
    for method, path, body in GUARDED:
        _error(entry.call(method, path, body=body), 401, MISSING)
        wrong = entry.call(method, path, body=body, key="not-a-key-0123456789")
        _error(wrong, 401, "invalid credentials")
    for path in ("/v2/health/live", "/v2/health/ready"):
        assert entry.call("GET", path)[0] == 200
    chat = json.dumps({"model": LLM, "prompt": "a", "max_tokens": 2}).encode()
    _error(entry.call("POST", "/v1/completions", body=chat), 401, MISSING, v1=True)


def test_another_models_key_is_403_and_the_right_key_200(entry: Entry) -> None:
    _error(entry.call(*INFER_A[:2], body=INFER_A[2], key=LLM_USER), 403, FORBIDDEN_A)
    _error(entry.call("GET", "/v2/models/a/stats", key=LLM_USER), 403, FORBIDDEN_A)
    _error(entry.call("GET", "/v2/models/b", key=USER), 403, "may not use model 'b'")
    status, _, body = entry.call(*INFER_A[:2], body=INFER_A[2], key=USER)
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2, 4, 6, 8]
    assert entry.call("GET", "/v2/models/a/stats", key=USER)[0] == 200
    assert entry.call("GET", "/v2/models/a", key=USER)[0] == 200
    # The OpenAI routes check the model the body names.
    chat = json.dumps({"model": LLM, "prompt": "a", "max_tokens": 2}).encode()
    _error(entry.call("POST", "/v1/completions", body=chat, key=USER), 403, "tiny", v1=True)
    status, _, body = entry.call("POST", "/v1/completions", body=chat, key=LLM_USER)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    listed = entry.call("GET", "/v1/models", key=USER)
    assert listed[0] == 200 and json.loads(listed[2])["data"] == []
    listed = entry.call("GET", "/v1/models", key=LLM_USER)
    assert [m["id"] for m in json.loads(listed[2])["data"]] == [LLM]


def test_admin_routes_need_the_admin_key(entry: Entry) -> None:
    admin_routes = [
        ("GET", "/metrics", None),
        ("POST", "/v2/repository/index", b"{}"),
        ("GET", "/v2/models/stats", None),
    ]
    for method, path, body in admin_routes:
        _error(entry.call(method, path, body=body, key=USER), 403, ADMIN_ONLY)
        status, _, out = entry.call(method, path, body=body, key=ADMIN)
        assert status == 200, (path, out)
    index = json.loads(entry.call("POST", "/v2/repository/index", body=b"{}", key=ADMIN)[2])
    assert {m["name"] for m in index} == {"a", "b", LLM}
    _error(entry.call("POST", "/v2/repository/models/a/unload", key=USER), 403, ADMIN_ONLY)
    assert entry.call(*INFER_A[:2], body=INFER_A[2], key=ADMIN)[0] == 200  # (every model)


def test_past_the_rate_limit_is_429_with_retry_after_per_client_address(entry: Entry) -> None:
    source = "127.0.0.3"
    statuses = []
    for _ in range(BURST + 20):
        answer = entry.call("GET", "/v2/models/a/ready", key=USER, source=source)
        statuses.append(answer[0])
        if answer[0] == 429:
            break
    assert statuses[-1] == 429, statuses
    assert statuses.count(200) >= BURST - 1, statuses  # the burst passed
    _error(answer, 429, "rate limit of 1 requests/s exceeded")
    assert int(answer[1]["retry-after"]) >= 1
    # Refused before the key is looked at; probes stay open; another address is served.
    _error(entry.call("GET", "/metrics", source=source), 429, "rate limit")
    assert entry.call("GET", "/v2/health/ready", source=source)[0] == 200
    assert entry.call("GET", "/v2/models/a/ready", key=USER, source="127.0.0.4")[0] == 200


def test_body_and_header_limits(entry: Entry) -> None:
    big = b" " * (MAX_BODY + 1)
    for key in (USER, None):  # (a body too large is refused before the key, as by serve)
        _error(entry.call("POST", "/v2/models/a/infer", body=big, key=key), 413,
               "max_request_bytes")  # fmt: skip
    bomb = gzip.compress(b"[" + b" " * (MAX_INFLATED * 2) + b"]")
    answer = entry.call(
        "POST", "/v2/models/a/infer", body=bomb, key=USER, headers={"content-encoding": "gzip"}
    )
    _error(answer, 413, "max_decompressed_bytes")
    nested = dict(X)
    nested["parameters"] = {"junk": [[]] * 3000}  # (a header past 4 kB is counted first)
    answer = entry.call("POST", "/v2/models/a/infer", body=json.dumps(nested).encode(), key=USER)
    _error(answer, 413, f"more than {MAX_CONTAINERS} lists and objects (max_json_containers)")
    many = {f"x-extra-{i}": "1" for i in range(60)}
    _error(entry.call("GET", "/v2/models/a/ready", key=USER, headers=many), 431,
           "http_max_headers")  # fmt: skip
    long = {"x-long": "v" * 5000}
    _error(entry.call("GET", "/v2/models/a/ready", key=USER, headers=long), 431,
           "http_max_header_bytes")  # fmt: skip


# ---------------------------------------------------------------------- refusing to start
NOT_HONOURED = [
    ("tls_client_ca: /etc/ca.pem\n", "tls_client_ca"),
    ("tls_cert: /etc/cert.pem\ntls_key: /etc/key.pem\n", "tls_cert"),
    ("shared_memory: system\n", "shared_memory"),
]


@pytest.mark.parametrize(("setting", "named"), NOT_HONOURED, ids=[n for _, n in NOT_HONOURED])
def test_the_lambda_handler_refuses_to_start_on_what_it_cannot_honour(
    tmp_path: Path, setting: str, named: str
) -> None:
    """Lambda's init phase (the import) fails, naming the setting: no model loads."""
    build_scale(tmp_path / "repo" / "a" / "1" / "model.onnx", 2.0)
    config = tmp_path / "server.yaml"
    config.write_text(setting)
    script = "import rtserve.serverless"
    env = {"RTSERVE_MODEL_REPOSITORY": str(tmp_path / "repo"), "RTSERVE_CONFIG": str(config)}
    done = _python(script, env)
    assert done.returncode != 0
    assert f"{named}: the Lambda handler cannot honour this setting" in done.stderr
    assert "model a ready" not in done.stderr


@pytest.mark.filterwarnings("ignore:coroutine 'RTServeDeployment.__del__' was never awaited")
@pytest.mark.parametrize(("setting", "named"), NOT_HONOURED, ids=[n for _, n in NOT_HONOURED])
def test_a_ray_replica_refuses_to_start_on_what_it_cannot_honour(
    tmp_path: Path, setting: str, named: str
) -> None:
    """The replica's constructor (Ray reports its error as the deployment's) raises,
    naming the setting, before any model loads."""
    pytest.importorskip("ray")
    import asyncio

    from rtserve.errors import ConfigError
    from rtserve.ray import RTServeDeployment

    build_scale(tmp_path / "repo" / "a" / "1" / "model.onnx", 2.0)
    config = tmp_path / "server.yaml"
    config.write_text(setting)
    replica = RTServeDeployment.__new__(RTServeDeployment)
    with pytest.raises(ConfigError, match=f"{named}: the Ray deployment cannot honour"):
        asyncio.run(RTServeDeployment.__init__(replica, str(tmp_path / "repo"), {}, str(config)))
    assert not replica.engine.started
    unreadable = {"auth_file": str(tmp_path / "missing.yaml")}
    with pytest.raises(ConfigError, match="cannot read the auth file"):
        asyncio.run(RTServeDeployment.__init__(replica, str(tmp_path / "repo"), unreadable))


def _python(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
