"""Generative bodies (``/v1`` and Triton's generate) within bounds decided before they are
parsed, Content-Encoding as V2 has it, and one credential header per request: a real
server with a tiny generative model (max_model_len 512: bodies up to 1 MiB, 16,384 items)
behind API keys, raw HTTP/1.1 clients."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator

import orjson
import pytest
import yaml

from tests.conftest import RunningServer, start_server
from tests.llm_models import build_llm
from tests.rawhttp import connect, read_response

KEY = "tiny-only-key-0123456789"
OTHER = "other-only-key-0123456789"
CHAT = [{"role": "user", "content": "hello there"}]
DECOMPRESSED_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("openai-limits-repo")
    build_llm(root, "tiny")
    build_llm(root, "other")
    work = tmp_path_factory.mktemp("openai-limits")
    auth = work / "auth.yaml"
    keys = [
        {"name": "tiny", "token": KEY, "models": ["tiny"]},
        {"name": "other", "token": OTHER, "models": ["other"]},
    ]
    auth.write_text(yaml.safe_dump({"keys": keys}))
    extra = ("--auth-file", str(auth), "--max-decompressed-bytes", str(DECOMPRESSED_LIMIT))
    running = start_server(root, work, *extra, timeout=300)
    yield running
    running.stop()


def _post(
    server: RunningServer,
    path: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    key: str = KEY,
) -> tuple[int, dict[str, str], bytes, float]:
    """(status, headers, body, seconds) of one POST on a fresh connection."""
    head = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    head.update(headers or {})
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    request = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{lines}\r\n"
    ).encode()
    sock = connect(server.http_port, timeout=30)
    try:
        started = time.perf_counter()
        sock.sendall(request + body)
        status, got, answer = read_response(sock, bytearray())
        return status, got, answer, time.perf_counter() - started
    finally:
        sock.close()


def _chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "tiny", "messages": CHAT, "max_tokens": 2, **fields})


def _message(answer: bytes) -> str:
    doc = orjson.loads(answer)
    error = doc["error"]
    return str(error["message"] if isinstance(error, dict) else error)


# ---------------------------------------------------------------------- bounds
@pytest.mark.parametrize(
    ("path", "body", "names"),
    [
        # 21 million empty lists, scaled to the limit: ~170k lists in ~1 MB
        (
            "/v1/chat/completions",
            _chat(extra=[[]] * 170_000),
            ("max_json_containers",),
        ),
        # 31 million token ids, scaled: 300k in ~0.9 MB
        (
            "/v1/completions",
            orjson.dumps({"model": "tiny", "prompt": [1] * 300_000}),
            ("items", "max_model_len"),
        ),
        # 20 million stop strings, scaled
        ("/v1/chat/completions", _chat(stop=["a"] * 200_000), ("items",)),
        # 4 million logit_bias entries, scaled
        (
            "/v1/chat/completions",
            _chat(logit_bias={str(i): 1 for i in range(60_000)}),
            ("items",),
        ),
        # Triton's generate: the same bounds
        (
            "/v2/models/tiny/generate",
            orjson.dumps({"text_input": "hi", "stop": ["a"] * 200_000}),
            ("items",),
        ),
    ],
    ids=["lists", "token-ids", "stop-strings", "logit-bias", "generate"],
)
def test_hostile_shapes_are_refused_before_parsing(
    server: RunningServer, path: str, body: bytes, names: tuple[str, ...]
) -> None:
    assert len(body) <= 1 << 20  # near the size limit, not over it
    status, _, answer, seconds = _post(server, path, body)
    assert status == 413, answer[:300]
    message = _message(answer)
    assert message.startswith("request body:"), message
    for name in names:
        assert name in message, message
    assert seconds < 2.0


def test_body_over_the_limit_is_refused_from_its_head(server: RunningServer) -> None:
    """A 63 MB body: refused on its Content-Length, before a byte of it is read."""
    sock = connect(server.http_port, timeout=10)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"authorization: Bearer " + KEY.encode() + b"\r\n"
            b"content-length: 63000000\r\n\r\n" + b"[" * 1000
        )
        status, _, answer = read_response(sock, bytearray())
    finally:
        sock.close()
    assert status == 413
    assert b"1048576" in answer  # the generative limit, not max_request_bytes (64 MiB)


def test_health_answers_while_big_bodies_are_refused(server: RunningServer) -> None:
    body = _chat(extra=[[]] * 170_000)
    stop = threading.Event()
    statuses: list[int] = []

    def attack() -> None:
        while not stop.is_set():
            statuses.append(_post(server, "/v1/chat/completions", body)[0])

    attackers = [threading.Thread(target=attack) for _ in range(2)]
    for t in attackers:
        t.start()
    try:
        time.sleep(0.3)
        worst = 0.0
        sock = connect(server.http_port)
        try:
            buf = bytearray()
            for _ in range(20):
                started = time.perf_counter()
                sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
                status, _, _ = read_response(sock, buf)
                worst = max(worst, time.perf_counter() - started)
                assert status == 200
                time.sleep(0.02)
        finally:
            sock.close()
    finally:
        stop.set()
        for t in attackers:
            t.join()
    assert statuses and set(statuses) == {413}
    assert worst < 0.5, f"a health check took {worst:.3f} s"


def test_field_bounds_name_the_field(server: RunningServer) -> None:
    status, _, answer, _ = _post(server, "/v1/chat/completions", _chat(stop=["a"] * 9))
    assert status == 400 and _message(answer).startswith("stop: expected at most 8")
    body = orjson.dumps({"model": "tiny", "prompt": [1] * 600})  # max_model_len 512
    status, _, answer, _ = _post(server, "/v1/completions", body)
    assert status == 400 and "max_model_len" in _message(answer)
    assert orjson.loads(answer)["error"]["param"] == "prompt"
    status, _, answer, _ = _post(server, "/v1/chat/completions", _chat(logit_bias={"1": 200}))
    assert status == 400 and _message(answer).startswith("logit_bias:")
    messages = [{"role": "user", "content": "hi"}] * 5000
    body = orjson.dumps({"model": "tiny", "messages": messages})
    status, _, answer, _ = _post(server, "/v1/chat/completions", body)
    assert status == 400 and _message(answer).startswith("messages: expected at most")


def test_another_models_key_is_refused_before_the_body_is_parsed(server: RunningServer) -> None:
    # Cut short: a 403 (not "not valid JSON") shows the key was checked before parsing.
    body = orjson.dumps({"model": "other", "messages": CHAT, "extra": [[]] * 10_000})[:-100]
    status, _, answer, _ = _post(server, "/v1/chat/completions", body)
    assert status == 403, answer[:200]
    assert orjson.loads(answer)["error"]["type"] == "permission_error"
    status, _, _, _ = _post(server, "/v1/chat/completions", _chat(max_tokens=1), key=OTHER)
    assert status == 403  # (the parsed request's model is checked too)


def test_ordinary_requests_still_answer(server: RunningServer) -> None:
    status, _, answer, _ = _post(server, "/v1/chat/completions", _chat())
    assert status == 200, answer[:300]
    assert orjson.loads(answer)["choices"][0]["message"]["role"] == "assistant"
    body = orjson.dumps({"text_input": "hello", "max_tokens": 2})
    status, _, answer, _ = _post(server, "/v2/models/tiny/generate", body)
    assert status == 200, answer[:300]


# ---------------------------------------------------------------------- Content-Encoding
def test_gzip_bodies_are_inflated_as_on_v2(server: RunningServer) -> None:
    gz = {"content-encoding": "gzip"}
    status, _, answer, _ = _post(server, "/v1/chat/completions", gzip.compress(_chat()), gz)
    assert status == 200, answer[:300]
    assert orjson.loads(answer)["object"] == "chat.completion"
    body = gzip.compress(orjson.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}))
    status, _, answer, _ = _post(server, "/v1/completions", body, {"content-encoding": "GZIP"})
    assert status == 200, answer[:300]
    body = gzip.compress(orjson.dumps({"text_input": "hello", "max_tokens": 2}))
    status, _, answer, _ = _post(server, "/v2/models/tiny/generate", body, gz)
    assert status == 200, answer[:300]


def test_unknown_encodings_and_bombs_are_refused_as_on_v2(server: RunningServer) -> None:
    status, _, answer, _ = _post(
        server, "/v1/chat/completions", _chat(), {"content-encoding": "br"}
    )
    assert status == 400
    assert "Content-Encoding: 'br' is not supported" in _message(answer)
    bomb = gzip.compress(b" " * (8 * DECOMPRESSED_LIMIT))
    gz = {"content-encoding": "gzip"}
    status, _, answer, _ = _post(server, "/v1/chat/completions", bomb, gz)
    assert status == 413 and "max_decompressed_bytes" in _message(answer)
    status, _, answer, _ = _post(server, "/v1/chat/completions", b"not gzip", gz)
    assert status == 400 and "corrupt body" in _message(answer)
    # Inflated, the body meets the same bounds as any other.
    status, _, answer, _ = _post(
        server, "/v1/chat/completions", gzip.compress(_chat(extra=[[]] * 170_000)), gz
    )
    assert status == 413 and "max_json_containers" in _message(answer)
    # V2 answers the same encodings the same way.
    status, _, answer, _ = _post(server, "/v2/models/tiny/infer", b"{}", {"content-encoding": "br"})
    assert status == 400 and "Content-Encoding: 'br' is not supported" in _message(answer)


# ---------------------------------------------------------------------- credentials
@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
@pytest.mark.parametrize("order", [(KEY, OTHER), (OTHER, KEY)])
def test_two_credential_headers_are_refused(
    server: RunningServer, header: str, order: tuple[str, str]
) -> None:
    first, second = order
    value = "Bearer {}" if header == "authorization" else "{}"
    sock = connect(server.http_port)
    try:
        sock.sendall(
            (
                "GET /v1/models HTTP/1.1\r\nhost: x\r\n"
                f"{header}: {value.format(first)}\r\n{header}: {value.format(second)}\r\n\r\n"
            ).encode()
        )
        status, _, answer = read_response(sock, bytearray())
    finally:
        sock.close()
    assert status == 400
    assert f"{header}: expected one such header, got several".encode() in answer
    assert KEY.encode() not in answer and OTHER.encode() not in answer
