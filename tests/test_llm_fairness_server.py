"""Fair share against a real server: one key's many unread streams do not hold every
generation slot from another key, a key's excess queued requests are refused (not another
key's), a lone key keeps every slot, and a stream its client leaves unread is paused out of
the batch (its KV blocks freed, counted) and resumes when read."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import yaml

from tests.conftest import RunningServer, start_server

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.llm_models import build_llm  # noqa: E402

A_KEY = "tenant-a-key-0123456789"
B_KEY = "tenant-b-key-0123456789"
ADMIN_KEY = "admin-key-0123456789abcdef"
CHAT = [{"role": "user", "content": "the cat sat on the mat"}]
SLOTS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("fair-repo")
    # "fair": four slots, eight queued requests per key, unread streams never paused (its
    # test holds them unread on purpose); "unread": streams unread for 0.5 s are paused.
    build_llm(
        root,
        "fair",
        llm={
            "max_num_seqs": SLOTS,
            "max_model_len": 1024,
            "max_waiting_per_tenant": 2 * SLOTS,
            "unread_timeout_s": 0,
        },
    )
    build_llm(root, "unread", llm={"max_model_len": 1024, "unread_timeout_s": 0.5})
    work = tmp_path_factory.mktemp("fair")
    auth = work / "auth.yaml"
    keys = [
        {"name": "a", "token": A_KEY, "models": "*"},
        {"name": "b", "token": B_KEY, "models": "*"},
        {"name": "admin", "token": ADMIN_KEY, "models": "*", "admin": True},
    ]
    auth.write_text(yaml.safe_dump({"keys": keys}))
    running = start_server(root, work, "--auth-file", str(auth))
    yield running
    running.stop()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def metric(server: RunningServer, name: str, model: str) -> float:
    text = httpx.get(f"{server.base}/metrics", headers=bearer(ADMIN_KEY), timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {model} not in /metrics")


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def unread_stream(server: RunningServer, key: str, body: dict[str, object]) -> socket.socket:
    """A streamed chat request on its own connection, whose answer the client leaves unread
    (a small receive buffer: the server's writes back up soon)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.http_port))
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: rtserve\r\n"
        f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_a_key_with_many_unread_streams_leaves_another_key_its_share(
    server: RunningServer,
) -> None:
    long = {"model": "fair", "messages": CHAT, "max_tokens": 1000, "ignore_eos": True}
    long["stream"] = True
    held = [unread_stream(server, A_KEY, long) for _ in range(SLOTS)]
    try:
        wait_for(
            lambda: metric(server, "rtserve_llm_running_sequences", "fair") == SLOTS,
            20,
            "key a runs in every slot",
        )
        held += [unread_stream(server, A_KEY, long) for _ in range(2 * SLOTS)]
        wait_for(
            lambda: metric(server, "rtserve_llm_waiting_sequences", "fair") == 2 * SLOTS,
            20,
            "key a's further streams wait",
        )
        # Key a's part of the queue is full: its next request is refused (429), not b's.
        short = {"model": "fair", "prompt": "the cat sat", "max_tokens": 4, "ignore_eos": True}
        refused = httpx.post(
            f"{server.base}/v1/completions", json=short, headers=bearer(A_KEY), timeout=30
        )
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert "max_waiting_per_tenant" in refused.json()["error"]["message"]

        start = time.monotonic()
        first = None
        with httpx.stream(
            "POST",
            f"{server.base}/v1/completions",
            json={**short, "stream": True},
            headers=bearer(B_KEY),
            timeout=30,
        ) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.monotonic() - start
                if line == "data: [DONE]":
                    break
        whole = time.monotonic() - start
        assert first is not None and first < 2.0, first
        assert whole < 3.0, whole
        assert metric(server, "rtserve_llm_fair_share_preemptions_total", "fair") >= 1
        # b gone, a alone again: its streams take every slot (throughput kept).
        wait_for(
            lambda: metric(server, "rtserve_llm_running_sequences", "fair") == SLOTS,
            5,
            "key a runs in every slot again",
        )
    finally:
        for sock in held:
            sock.close()
    wait_for(
        lambda: (
            metric(server, "rtserve_llm_running_sequences", "fair") == 0
            and metric(server, "rtserve_llm_waiting_sequences", "fair") == 0
            and metric(server, "rtserve_llm_kv_blocks_used", "fair") == 0
        ),
        20,
        "closed streams end and free their blocks",
    )


def _read_to_end(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    parts = []
    tail = b""
    deadline = time.monotonic() + timeout
    while b"data: [DONE]" not in tail and time.monotonic() < deadline:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        parts.append(chunk)
        tail = (tail + chunk)[-64:]
    return b"".join(parts)


def test_an_unread_stream_is_paused_out_of_its_slot_and_resumes_when_read(
    server: RunningServer,
) -> None:
    before = metric(server, "rtserve_llm_stalled_streams_total", "unread")
    body = {
        "model": "unread",
        "messages": CHAT,
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 20,  # (large events: the connection's buffers fill sooner)
    }
    sock = unread_stream(server, B_KEY, body)
    try:
        wait_for(
            lambda: metric(server, "rtserve_llm_stalled_streams_total", "unread") == before + 1,
            30,
            "the unread stream is paused",
        )
        assert metric(server, "rtserve_llm_paused_sequences", "unread") == 1
        assert metric(server, "rtserve_llm_running_sequences", "unread") == 0
        assert metric(server, "rtserve_llm_kv_blocks_used", "unread") == 0
        data = _read_to_end(sock, 60)
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" in data
    assert b'"finish_reason":"length"' in data
    assert data.count(b'"logprobs":{"content":[{') >= 600  # every token came, once resumed
    wait_for(
        lambda: (
            metric(server, "rtserve_llm_paused_sequences", "unread") == 0
            and metric(server, "rtserve_llm_kv_blocks_used", "unread") == 0
        ),
        10,
        "the stream ended and freed its blocks",
    )
