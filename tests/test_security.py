"""Authentication, rate limits and TLS with real clients (tritonclient HTTP and gRPC)."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import RunningServer, hold_connections, start_server
from tests.models import build_scale
from tests.v2 import x_input

USER = "user-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"


def repo(root: Path) -> Path:
    for name, k in (("a", 2.0), ("b", 3.0)):
        build_scale(root / name / "1" / "model.onnx", k)
        (root / name / "config.yaml").write_text("max_batch_size: 4\n")
    return root


def auth_file(path: Path) -> Path:
    path.write_text(
        f"keys:\n"
        f"  - {{name: app, token: {USER}, models: [a]}}\n"
        f"  - {{name: ops, token_env: RTSERVE_TEST_ADMIN, admin: true}}\n"
    )
    return path


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.fixture
def secured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("RTSERVE_TEST_ADMIN", ADMIN)
    s = start_server(
        repo(tmp_path / "repo"),
        tmp_path / "s",
        "--auth-file",
        str(auth_file(tmp_path / "auth.yaml")),
    )
    yield s
    s.stop()


def test_http_needs_a_valid_token_for_the_model_and_health_stays_open(secured) -> None:  # type: ignore[no-untyped-def]
    s = secured
    assert http_get(f"{s.base}/v2/health/ready")[0] == 200
    client = httpclient.InferenceServerClient(s.http)
    with pytest.raises(InferenceServerException, match="missing credentials"):
        client.infer("a", [x_input(httpclient)])
    with pytest.raises(InferenceServerException, match="invalid credentials"):
        client.infer("a", [x_input(httpclient)], headers={"Authorization": "Bearer wrong-token"})
    ok = client.infer("a", [x_input(httpclient)], headers={"Authorization": f"Bearer {USER}"})
    assert ok.as_numpy("y").tolist() == [[2.0] * 4]
    with pytest.raises(InferenceServerException, match="may not use model 'b'"):
        client.infer("b", [x_input(httpclient)], headers={"Authorization": f"Bearer {USER}"})
    # Admin routes: metrics, repository index, statistics of every model.
    assert http_get(f"{s.base}/metrics", {"Authorization": f"Bearer {USER}"})[0] == 403
    assert http_get(f"{s.base}/metrics")[0] == 401
    status, body, _ = http_get(f"{s.base}/metrics", {"x-api-key": ADMIN})
    assert status == 200 and b"rtserve_requests_total" in body
    status, body, _ = http_get(f"{s.base}/v2/models/a/config", {"Authorization": f"Bearer {USER}"})
    assert status == 200 and json.loads(body)["name"] == "a"
    # the refused inferences are counted under their model, as on gRPC (they left no trace)
    line = next(
        x for x in body_of_metrics(s).splitlines()
        if x.startswith('rtserve_requests_total{model="a",outcome="client_error"')
    )  # fmt: skip
    assert float(line.rsplit(" ", 1)[1]) == 2  # no key, a wrong key


def body_of_metrics(s: RunningServer) -> str:
    return http_get(f"{s.base}/metrics", {"x-api-key": ADMIN})[1].decode()


def test_grpc_needs_a_valid_token_in_metadata(secured) -> None:  # type: ignore[no-untyped-def]
    s = secured
    client = grpcclient.InferenceServerClient(s.grpc)
    assert client.is_server_live()
    with pytest.raises(InferenceServerException, match="missing credentials") as info:
        client.infer("a", [x_input(grpcclient)])
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    ok = client.infer("a", [x_input(grpcclient)], headers={"authorization": f"Bearer {USER}"})
    assert ok.as_numpy("y").tolist() == [[2.0] * 4]
    with pytest.raises(InferenceServerException) as info:
        client.infer("b", [x_input(grpcclient)], headers={"authorization": f"Bearer {USER}"})
    assert info.value.status() == "StatusCode.PERMISSION_DENIED"
    with pytest.raises(InferenceServerException):
        client.get_model_repository_index(headers={"authorization": f"Bearer {USER}"})
    index = client.get_model_repository_index(headers={"authorization": f"Bearer {ADMIN}"})
    assert {m.name for m in index.models} == {"a", "b"}
    # a model's readiness needs its key on both protocols (open over gRPC, it told anyone
    # which models exist); the server's own probes stay open
    assert client.is_server_ready()
    with pytest.raises(InferenceServerException, match="missing credentials"):
        client.is_model_ready("a")
    assert client.is_model_ready("a", headers={"authorization": f"Bearer {USER}"})
    assert http_get(f"{s.base}/v2/models/a/ready")[0] == 401


def test_rate_limit_answers_429_with_retry_after_and_other_clients_are_unaffected(
    tmp_path: Path,
) -> None:
    s = start_server(
        repo(tmp_path / "repo"), tmp_path / "s", "--rate-limit", "2", "--rate-burst", "3"
    )
    try:
        statuses = [http_get(f"{s.base}/v2/models/a")[0] for _ in range(6)]
        assert statuses[:3] == [200, 200, 200] and 429 in statuses[3:]
        status, body, headers = http_get(f"{s.base}/v2/models/a")
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert b"rate limit" in body
        assert http_get(f"{s.base}/v2/health/live")[0] == 200  # probes are never limited
    finally:
        s.stop()


def test_a_grpc_client_with_a_retry_policy_waits_for_the_servers_pushback(
    tmp_path: Path,
) -> None:
    """A rate-limited gRPC call carries when to retry (``grpc-retry-pushback-ms``); grpcio's
    own retry policy honours it: the retried call waits that long, then is answered."""
    s = start_server(
        repo(tmp_path / "repo"), tmp_path / "s", "--rate-limit", "1", "--rate-burst", "1"
    )
    retrying = {
        "methodConfig": [
            {
                "name": [{"service": "inference.GRPCInferenceService"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.01s",
                    "maxBackoff": "0.05s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["RESOURCE_EXHAUSTED"],
                },
            }
        ]
    }
    plain = grpc.insecure_channel(s.grpc, options=[("grpc.enable_retries", 0)])
    retried = grpc.insecure_channel(
        s.grpc,
        options=[("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(retrying))],
    )
    try:
        ask = pb.ModelMetadataRequest(name="a")
        pb_grpc.GRPCInferenceServiceStub(plain).ModelMetadata(ask)  # the burst's one token
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.GRPCInferenceServiceStub(plain).ModelMetadata(ask)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(refused.value.trailing_metadata() or ())
        pushback_ms = int(trailers["grpc-retry-pushback-ms"])
        assert 500 <= pushback_ms <= 1000 and trailers["retry-after"] == "1", trailers
        start = time.monotonic()
        answer = pb_grpc.GRPCInferenceServiceStub(retried).ModelMetadata(ask)
        waited = time.monotonic() - start
        assert answer.name == "a"
        # Refused at once, retried after the pushback (not the policy's 10-50 ms backoff).
        assert waited >= 0.4, waited
    finally:
        plain.close()
        retried.close()
        s.stop()


def make_cert(tmp: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_over_http_and_grpc_with_tritonclient(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    ctx = ssl.create_default_context(cafile=str(cert))
    s = start_server(
        repo(tmp_path / "repo"),
        tmp_path / "s",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        tls=ctx,
    )
    try:
        with urllib.request.urlopen(
            f"https://127.0.0.1:{s.http_port}/v2/health/live", context=ctx
        ) as r:
            assert r.status == 200
        http = httpclient.InferenceServerClient(
            s.http,
            ssl=True,
            ssl_context_factory=lambda: ssl.create_default_context(cafile=str(cert)),
        )
        assert http.infer("a", [x_input(httpclient)]).as_numpy("y").tolist() == [[2.0] * 4]
        grpc = grpcclient.InferenceServerClient(s.grpc, ssl=True, root_certificates=str(cert))
        assert grpc.infer("a", [x_input(grpcclient)]).as_numpy("y").tolist() == [[2.0] * 4]
        # Plaintext is refused on both ports.
        with pytest.raises(Exception):  # noqa: B017 - any failure: no plaintext answer
            urllib.request.urlopen(f"http://127.0.0.1:{s.http_port}/v2/health/live", timeout=5)
    finally:
        s.stop()


def test_tls_handshakes_in_progress_count_towards_the_connection_caps(tmp_path: Path) -> None:
    """Clients that connect and never send a ClientHello used to hold a descriptor each
    without bound (the HTTP cap counted connections only after their handshake; gRPC had
    no cap): now past the cap the next connections are closed at once, and when the
    silent ones go, a real client is served again."""
    import os
    import socket

    cert, key = make_cert(tmp_path)
    ctx = ssl.create_default_context(cafile=str(cert))
    s = start_server(
        repo(tmp_path / "repo"), tmp_path / "s", "--tls-cert", str(cert), "--tls-key",
        str(key), "--http-max-connections", "16", tls=ctx,
    )  # fmt: skip
    silent: list[socket.socket] = []
    try:
        fds = len(os.listdir(f"/proc/{s.proc.pid}/fd"))
        silent, closed = hold_connections(s.http_port, 40)
        assert closed >= 40 - 16, closed  # those past the cap: closed, no handshake
        assert len(os.listdir(f"/proc/{s.proc.pid}/fd")) <= fds + 16 + 2
        for sock in silent:
            sock.close()
        silent.clear()
        time.sleep(0.5)
        with urllib.request.urlopen(
            f"https://127.0.0.1:{s.http_port}/v2/health/live", context=ctx, timeout=10
        ) as r:
            assert r.status == 200
    finally:
        for sock in silent:
            sock.close()
        s.stop()
