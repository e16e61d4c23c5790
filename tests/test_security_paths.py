"""One canonical path for the guard and the router: every route, spelled every way, for
every kind of key and for none, is authorised exactly as its plain spelling is."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from rtserve.server.paths import canonical_path
from rtserve.server.security import grpc_address
from tests.conftest import RunningServer, start_server
from tests.models import build_scale
from tests.rawhttp import connect, read_response
from tests.v2 import x_input

KEYS = {
    "admin": "admin-key-0123456789",
    "app": "app-key-0123456789",
    "other": "other-key-0123456789",
}
BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()

# (method, canonical path, body)
ROUTES = [
    ("POST", "/v2/models/a/infer", BODY),
    ("POST", "/v2/models/a/versions/1/infer", BODY),
    ("GET", "/v2/models/a", b""),
    ("GET", "/v2/models/a/ready", b""),
    ("GET", "/v2/models/a/config", b""),
    ("GET", "/v2/models/a/stats", b""),
    ("GET", "/v2/models/stats", b""),
    ("POST", "/v2/repository/index", b"{}"),
    ("GET", "/metrics", b""),
    ("GET", "/dashboard", b""),
    ("GET", "/v2", b""),
    ("GET", "/v2/health/ready", b""),
]


def _encode_first_letter(segment: str) -> str:
    return f"%{ord(segment[0]):02x}{segment[1:]}"


def same_route(path: str) -> list[str]:
    """Spellings that name the same route: escapes, merged slashes, a trailing slash."""
    segments = path.strip("/").split("/")
    out = ["/" + "/".join(_encode_first_letter(s) for s in segments)]
    out.append("/" + "".join(f"%{ord(c):02X}" for c in segments[0]) + path[len(segments[0]) + 1 :])
    out.append("/" + "//".join(segments))
    out.append("//" + path.lstrip("/") + "/")
    return out


def refused(path: str) -> list[str]:
    """Spellings refused with 400: an encoded slash, dot segments (raw and encoded)."""
    segments = path.strip("/").split("/")
    out = []
    if len(segments) > 1:
        out.append("/" + segments[0] + "%2F" + "/".join(segments[1:]))
        out.append("/" + "%2f".join(segments))
        out.append("/" + segments[0] + "/./" + "/".join(segments[1:]))
        out.append("/" + segments[0] + "/x/../" + "/".join(segments[1:]))
        out.append("/" + segments[0] + "/%2e%2E/" + "/".join(segments[1:]))
    out.append(path + "%5C")
    out.append(path + "%00")
    return out


def other_case(path: str) -> list[str]:
    return [v for v in (path.upper(), path.replace("v2", "V2")) if v != path]


def request(port: int, method: str, path: str, body: bytes, key: str | None) -> int:
    sock = connect(port)
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        if key is not None:
            head += f"Authorization: Bearer {key}\r\n"
        sock.sendall(head.encode() + b"\r\n" + body)
        return read_response(sock, bytearray())[0]
    finally:
        sock.close()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("paths")
    for name, k in (("a", 2.0), ("b", 3.0)):
        build_scale(root / "repo" / name / "1" / "model.onnx", k)
        (root / "repo" / name / "config.yaml").write_text("max_batch_size: 4\n")
    auth = root / "auth.yaml"
    auth.write_text(
        "keys:\n"
        f"  - {{name: ops, token: {KEYS['admin']}, admin: true}}\n"
        f"  - {{name: app, token: {KEYS['app']}, models: [a]}}\n"
        f"  - {{name: other, token: {KEYS['other']}, models: [b]}}\n"
    )
    s = start_server(root / "repo", root / "s", "--auth-file", str(auth))
    yield s
    s.stop()


def test_plain_spellings_are_authorised_by_key_kind(secured: RunningServer) -> None:
    port = secured.http_port
    for method, path, body in ROUTES:
        open_route = path.startswith("/v2/health") or path == "/dashboard"  # a static page
        admin_route = path in ("/v2/models/stats", "/v2/repository/index", "/metrics")
        model_route = path.startswith("/v2/models/a")
        expected = {
            None: 200 if open_route else 401,
            "admin": 200,
            "app": 403 if admin_route else 200,
            "other": 403 if admin_route or model_route else 200,
        }
        for kind, want in expected.items():
            key = None if kind is None else KEYS[kind]
            assert request(port, method, path, body, key) == want, (kind, method, path)


@pytest.mark.parametrize("kind", [None, "admin", "app", "other"])
def test_every_spelling_of_every_route_gets_the_plain_spellings_answer(
    secured: RunningServer, kind: str | None
) -> None:
    port = secured.http_port
    key = None if kind is None else KEYS[kind]
    for method, path, body in ROUTES:
        want = request(port, method, path, body, key)
        for variant in same_route(path):
            got = request(port, method, variant, body, key)
            assert got == want, (kind, method, variant, got, want)
        for variant in refused(path):
            got = request(port, method, variant, body, key)
            assert got == 400, (kind, method, variant, got)
        for variant in other_case(path):
            got = request(port, method, variant, body, key)
            assert got in (401, 403, 404), (kind, method, variant, got)


def test_the_issues_requests_with_another_models_key_are_refused(secured: RunningServer) -> None:
    port, key = secured.http_port, KEYS["other"]
    for method, path, body in [
        ("POST", "/v2%2Fmodels%2Fa/infer", BODY),
        ("POST", "/%76%32/models/a/infer", BODY),
        ("POST", "/v2/%6dodels/a/infer", BODY),
        ("POST", "/%76%32/repository/index", b"{}"),
        ("GET", "/%6detrics", b""),
        # /%64ashboard: the page is static and open to all now; its data are /metrics'.
        ("GET", "/v2/models%2Fstats", b""),
        ("GET", "/v2%2Fmodels%2Fa%2Fconfig", b""),
    ]:
        assert request(port, method, path, body, key) in (400, 403), path


def test_a_bad_path_is_a_400_naming_the_rule(secured: RunningServer) -> None:
    sock = connect(secured.http_port)
    try:
        sock.sendall(b"GET /v2/%2e%2e/metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = read_response(sock, bytearray())
    finally:
        sock.close()
    assert status == 400 and b"'..' segments are not allowed" in body
    # The server keeps serving.
    client = httpclient.InferenceServerClient(secured.http)
    assert client.is_server_ready()


def test_canonical_path_rules() -> None:
    assert canonical_path(b"/v2/models/a/infer") == "/v2/models/a/infer"
    assert canonical_path(b"/%76%32//models/a/") == "/v2/models/a"
    assert canonical_path(b"/v2/models/my%20model") == "/v2/models/my model"
    assert canonical_path(b"/") == "/"
    for bad in (b"v2", b"/a%2fb", b"/a/%zz", b"/a/..", b"/a/%2E", b"/a%00", b"/a/%c3%28"):
        with pytest.raises(Exception, match="request path"):
            canonical_path(bad)


def test_grpc_peer_addresses_match_http_peer_addresses() -> None:
    assert grpc_address("ipv4:127.0.0.1:5555") == "127.0.0.1"
    assert grpc_address("ipv6:[::1]:5555") == "::1"
    assert grpc_address("unix:/tmp/s") == "unix:/tmp/s"


def test_http_and_grpc_share_one_rate_limit_bucket_per_address(tmp_path: Path) -> None:
    build_scale(tmp_path / "repo" / "a" / "1" / "model.onnx", 2.0)
    s = start_server(tmp_path / "repo", tmp_path / "s", "--rate-limit", "1", "--rate-burst", "4")
    try:
        http = httpclient.InferenceServerClient(s.http)
        for _ in range(4):  # the burst, spent over HTTP
            http.infer("a", [x_input(httpclient)])
        g = grpcclient.InferenceServerClient(s.grpc)
        with pytest.raises(InferenceServerException) as info:
            g.infer("a", [x_input(grpcclient)])
        assert info.value.status() == str(grpc.StatusCode.RESOURCE_EXHAUSTED)
        time.sleep(1.2)  # one token back: one more call passes, on either protocol
        assert g.infer("a", [x_input(grpcclient)]).as_numpy("y").tolist() == [[2.0] * 4]
    finally:
        s.stop()


def test_a_request_id_that_could_forge_log_lines_is_refused_on_both_protocols(
    tmp_path: Path,
) -> None:
    build_scale(tmp_path / "repo" / "a" / "1" / "model.onnx", 2.0)
    s = start_server(tmp_path / "repo", tmp_path / "s", "--access-log")
    try:
        forged = "abc status=500 model=\x85x"
        sock = connect(s.http_port)
        try:
            sock.sendall(
                b"POST /v2/models/a/infer HTTP/1.1\r\nHost: x\r\nx-request-id: "
                + forged.encode("latin-1")
                + b"\r\nContent-Length: %d\r\n\r\n" % len(BODY)
                + BODY
            )
            status, _, body = read_response(sock, bytearray())
        finally:
            sock.close()
        assert status == 400 and b"x-request-id" in body
        g = grpcclient.InferenceServerClient(s.grpc)
        with pytest.raises(InferenceServerException, match="x-request-id") as info:
            g.infer("a", [x_input(grpcclient)], headers={"x-request-id": "abc status=500"})
        assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        ok = httpclient.InferenceServerClient(s.http).infer(
            "a", [x_input(httpclient)], headers={"x-request-id": "req-1:ok"}
        )
        assert ok.get_response()["outputs"][0]["name"] == "y"
        time.sleep(0.3)
        log = s.log()
        assert "request_id=req-1:ok" in log
        assert "status=500" not in log and "\x85" not in log
    finally:
        s.stop()
