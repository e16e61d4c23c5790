"""Every API over a generative model, end to end: a real server on 127.0.0.1 serving a tiny
random-weight Llama (``backend: llm``), driven by the official ``openai`` client, raw
sockets (SSE framing), Triton's generate extension, tritonclient's gRPC streaming client
and the in-process ``Engine.generate``. Greedy decoding makes every API's text comparable.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tests.conftest import RunningServer, start_server
from tests.llm_models import build_llm
from tests.rawhttp import connect, read_response
from tests.test_observability import OtlpReceiver

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Write a short story about a cat."}]


@pytest.fixture(scope="module")
def llm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llm-repo")
    build_llm(root, MODEL)
    return root


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def llm_server(
    llm_repo: Path, otlp: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    work = tmp_path_factory.mktemp("llm-server")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # spans exported within 0.1 s
    try:
        s = start_server(llm_repo, work, "--access-log", "--trace-endpoint", otlp.url)
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
    yield s
    s.stop()


@pytest.fixture
def client(llm_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{llm_server.base}/v1", api_key="unused", max_retries=0)


def _post(server: RunningServer, path: str, doc: Any) -> tuple[int, dict[str, str], bytes]:
    sock = connect(server.http_port)
    try:
        body = json.dumps(doc).encode()
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        return read_response(sock, bytearray())
    finally:
        sock.close()


def _metric(server: RunningServer, name: str, **labels: str) -> float:
    """The sum of a metric's samples (matching ``labels``) in /metrics."""
    with urllib.request.urlopen(f"{server.base}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_idle(server: RunningServer, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if _metric(server, "rtserve_llm_running_sequences") == 0 and (
            _metric(server, "rtserve_llm_waiting_sequences") == 0
        ):
            return
        time.sleep(0.05)
    raise AssertionError("sequences still running after the client went away")


# ---------------------------------------------------------------------- the openai client
def test_chat_non_streaming_and_streaming_agree(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert whole.usage is not None and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the same text streamed or not
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_with_logprobs_and_echo(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="the cat sat", max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 6
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.token_logprobs is not None and all(v <= 0 for v in lp.token_logprobs)

    streamed = client.completions.create(
        model=MODEL, prompt="the cat sat", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    echoed = client.completions.create(
        model=MODEL, prompt="the cat sat", max_tokens=6, temperature=0, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert echoed.choices[0].text == "the cat sat" + choice.text


def test_completions_echo_scores_the_prompt(client: openai.OpenAI) -> None:
    """echo + logprobs: the prompt's tokens first (the first scored by nothing), offsets in
    the echoed text; token ids echo as their text; max_tokens 0 answers the prompt scored."""
    prompt = "the cat sat"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.text_offset
    assert lp.top_logprobs is not None
    assert choice.text.startswith(prompt) and "".join(lp.tokens) == choice.text
    n = out.usage.prompt_tokens if out.usage else 0
    assert len(lp.tokens) == n + 3 and "".join(lp.tokens[:n]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(text for text in lp.top_logprobs[1:])  # (1 alternative: a non-empty dict)
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert choice.text[offset : offset + len(token)] == token
    assert lp.text_offset[n] == len(prompt)

    ids = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0, echo=True
    )
    assert ids.choices[0].text.startswith(_decoded_ids([5, 6, 7]))

    scored = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    assert scored.choices[0].text == prompt and scored.usage is not None
    assert scored.usage.completion_tokens == 0
    slp = scored.choices[0].logprobs
    assert slp is not None and slp.token_logprobs == lp.token_logprobs[:n]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def _decoded_ids(ids: list[int]) -> str:
    from tests.llm_models import build_tokenizer

    text: str = build_tokenizer().decode(ids, skip_special_tokens=True)
    return text


def test_chat_logprob_bytes_decode_to_their_tokens(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Repeat: 😀😃"}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    for entry in logprobs.content:
        assert entry.bytes is not None
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        for alt in entry.top_logprobs:
            assert alt.bytes is not None
            assert bytes(alt.bytes).decode("utf-8", "replace") == alt.token


def test_models_listing(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# ---------------------------------------------------------------------- errors
def _error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("kwargs", "param", "fragment"),
    [
        ({"max_tokens": -1}, "max_tokens", "expected an integer"),
        ({"n": 17}, "n", "[1, 16]"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "robot"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content", "string"),
        ({"messages": "hello"}, "messages", "non-empty list"),
        ({"messages": [{"role": "user", "content": "cat " * 600}]}, "messages", "max_model_len"),
        ({"temperature": 9}, "temperature", "[0, 2]"),
        ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
        # fields of other servers: honoured within their bounds
        ({"extra_body": {"min_tokens": -1}}, "min_tokens", "[0, "),
        ({"extra_body": {"repetition_penalty": 3}}, "repetition_penalty", "(0, 2]"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty strings"),
        ({"top_logprobs": 2}, "top_logprobs", "absent unless logprobs is true"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "unless stream"),
        ({"modalities": ["audio"]}, "modalities", "not supported"),
        ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids", "token ids"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": "f()",
                    },
                ]
            },
            "messages[1].tool_calls",
            "expected a list of tool calls",
        ),
    ],
)
def test_bad_requests_get_openai_errors(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str, fragment: str
) -> None:
    request: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
    request.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    error = _error_of(info.value)
    assert info.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"]
    # The server keeps serving.
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert ok.choices[0].message.content is not None


def test_sampling_edges_are_honoured_and_harm_no_other_request(
    client: openai.OpenAI, llm_repo: Path
) -> None:
    """A temperature too small to divide by is greedy (it made NaN logits that failed every
    sequence in flight); stop_token_ids end the answer at that token; max_completion_tokens
    wins over max_tokens (as vLLM); tool_choice "none" asks for nothing to be done."""
    from concurrent.futures import ThreadPoolExecutor

    import transformers

    def chat(**kwargs: Any) -> Any:
        request: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 12}
        request.update(kwargs)
        return client.chat.completions.create(**request)

    greedy = chat(temperature=0)
    with ThreadPoolExecutor(4) as pool:
        victims = [pool.submit(chat, temperature=0, max_tokens=24) for _ in range(3)]
        tiny = [pool.submit(chat, temperature=t) for t in (1e-40, 1e-30, 1e-6)]
        for f in tiny:
            assert f.result().choices[0].message.content == greedy.choices[0].message.content
        for f in victims:
            assert f.result().choices[0].finish_reason in ("length", "stop")
    seeded: dict[str, Any] = {"model": MODEL, "prompt": "the cat", "max_tokens": 12, "seed": 7}
    answer = client.completions.create(**seeded, logprobs=0, extra_body={"ignore_eos": True})
    tokens = answer.choices[0].logprobs.tokens  # type: ignore[union-attr]
    tokenizer = transformers.AutoTokenizer.from_pretrained(llm_repo / MODEL / "1")
    k, stop_id = next(
        (k, ids[0])
        for k in range(1, len(tokens))
        if len(ids := tokenizer.encode(tokens[k], add_special_tokens=False)) == 1
        and all(tokenizer.encode(t, add_special_tokens=False) != ids for t in tokens[:k])
    )
    stopped = client.completions.create(
        **seeded, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == "".join(tokens[:k])
    both = chat(
        temperature=0, max_tokens=2, max_completion_tokens=5, extra_body={"ignore_eos": True}
    )
    assert both.usage is not None and both.usage.completion_tokens == 5
    none = chat(temperature=0, tool_choice="none")
    assert none.choices[0].message.content == greedy.choices[0].message.content


def test_unknown_model_is_404_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    error = _error_of(info.value)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "nope" in error["message"]


def test_prompt_longer_than_max_model_len_completions(llm_server: RunningServer) -> None:
    status, headers, body = _post(
        llm_server, "/v1/completions", {"model": MODEL, "prompt": "cat " * 600}
    )
    assert status == 400 and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["param"] == "prompt" and "max_model_len (512)" in error["message"]
    status, _, body = _post(llm_server, "/v1/completions", {"model": MODEL, "prompt": [1] * 3})
    assert status == 200, body


def test_megabytes_of_prompt_are_refused_before_tokenizing(llm_server: RunningServer) -> None:
    # 0.9 MB of text (under the 1 MiB generative body limit): far more than 512 tokens can
    # hold. Tokenizing it would hold the server for seconds; it is refused on its length in
    # characters. (8 MB bodies are refused on their size: tests/test_openai_limits.py.)
    huge = "a" * 900_000
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": huge}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": huge}]}, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": [1] * 10_000}, "prompt"),
    ]  # fmt: skip
    for path, body, field in cases:
        start = time.perf_counter()
        status, _, raw = _post(llm_server, path, body)
        assert status == 400, raw[:200]
        error = json.loads(raw)["error"]
        assert error["param"] == field and "max_model_len" in error["message"], error
        assert time.perf_counter() - start < 5.0  # (parsing 8 MB of JSON, not tokenizing it)
    # Under that bound but past 8 characters a token: the tokens of a prefix refuse it.
    status, _, raw = _post(llm_server, "/v1/completions", {"model": MODEL, "prompt": "cat " * 2500})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "prompt", raw[:200]
    assert "in its first 4096 characters alone" in error["message"], error
    status, _, raw = _post(
        llm_server, f"/v2/models/{MODEL}/generate", {"text_input": huge, "parameters": {}}
    )
    assert status == 400 and "characters" in json.loads(raw)["error"], raw[:200]
    status, _, raw = _post(llm_server, "/v1/completions", {"model": MODEL, "prompt": "cat"})
    assert status == 200, raw


def test_malformed_body_and_unknown_route(llm_server: RunningServer) -> None:
    sock = connect(llm_server.http_port)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\n\r\n{nope")
        status, _, body = read_response(sock, bytearray())
        assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        status, _, body = read_response(sock, bytearray())
        assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    finally:
        sock.close()


# ---------------------------------------------------------------------- SSE on the wire
def _read_chunked(sock: Any, buf: bytearray) -> tuple[str, bytes]:
    """(head, de-chunked body) of one chunked response."""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    data = bytearray(rest)
    body = bytearray()
    while True:
        while b"\r\n" not in data:
            data += sock.recv(65536)
        size_line, _, data = bytes(data).partition(b"\r\n")
        size = int(size_line, 16)
        while len(data) < size + 2:
            data += sock.recv(65536)
        body += data[:size]
        data = bytearray(data[size + 2 :])
        if size == 0:
            buf[:] = data
            return head.decode("latin-1"), bytes(body)


def test_sse_framing_then_keep_alive(llm_server: RunningServer) -> None:
    sock = connect(llm_server.http_port)
    try:
        doc = json.dumps(
            {"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": True}
        ).encode()
        request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
        sock.sendall(request % (len(doc), doc))
        buf = bytearray()
        head, body = _read_chunked(sock, buf)
        assert head.startswith("HTTP/1.1 200")
        assert "content-type: text/event-stream" in head and "transfer-encoding: chunked" in head
        events = body.split(b"\n\n")
        assert events[-1] == b"" and events[-2] == b"data: [DONE]"
        for event in events[:-2]:
            assert event.startswith(b"data: {")
            json.loads(event[6:])
        # The same connection serves the next request.
        sock.sendall(request % (len(doc), doc))
        head, body = _read_chunked(sock, buf)
        assert head.startswith("HTTP/1.1 200") and body.endswith(b"data: [DONE]\n\n")
    finally:
        sock.close()


@pytest.mark.parametrize("stream", [True, False])
def test_client_gone_stops_the_sequence(llm_server: RunningServer, stream: bool) -> None:
    """A client that disconnects mid-answer: its sequence is aborted at the next step (the
    abort counter moves, the running gauge returns to 0) and the server keeps serving."""
    aborted = _metric(llm_server, "rtserve_llm_requests_finished_total", reason="abort")
    generated = _metric(llm_server, "rtserve_llm_generation_tokens_total")
    sock = connect(llm_server.http_port)
    doc = json.dumps(
        {"model": MODEL, "prompt": "the cat", "max_tokens": 500, "ignore_eos": True,
         "stream": stream},
    ).encode()  # fmt: skip
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(doc), doc))
    if stream:
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(65536)
    else:
        deadline = time.monotonic() + 10
        while _metric(llm_server, "rtserve_llm_running_sequences") < 1:
            assert time.monotonic() < deadline, "the sequence never started"
    sock.close()
    _wait_idle(llm_server)
    assert _metric(llm_server, "rtserve_llm_requests_finished_total", reason="abort") == aborted + 1
    assert _metric(llm_server, "rtserve_llm_generation_tokens_total") - generated < 500
    status, _, _ = _post(llm_server, "/v1/completions", {"model": MODEL, "prompt": "a"})
    assert status == 200


def test_many_streams_half_abandoned(llm_server: RunningServer) -> None:
    """16 concurrent streams, 8 closed after their first events: the kept ones end with
    [DONE] and the whole text, the closed ones are aborted, nothing keeps decoding."""
    aborted = _metric(llm_server, "rtserve_llm_requests_finished_total", reason="abort")
    generated = _metric(llm_server, "rtserve_llm_generation_tokens_total")
    doc = json.dumps(
        {"model": MODEL, "prompt": "the cat", "max_tokens": 300, "ignore_eos": True,
         "stream": True, "stream_options": {"include_usage": True}},
    ).encode()  # fmt: skip
    request = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(doc), doc)
    socks = [connect(llm_server.http_port) for _ in range(16)]
    for sock in socks:
        sock.sendall(request)
    for sock in socks[:8]:
        got = b""
        while got.count(b"data: ") < 2:
            got += sock.recv(65536)
        sock.close()
    for sock in socks[8:]:
        head, body = _read_chunked(sock, bytearray())
        sock.close()
        events = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
        assert body.endswith(b"data: [DONE]\n\n") and events[-2]["choices"][0]["finish_reason"]
        assert events[-1]["usage"]["completion_tokens"] == 300
    _wait_idle(llm_server)
    closed = _metric(llm_server, "rtserve_llm_requests_finished_total", reason="abort") - aborted
    assert closed >= 1  # the closed ones that had not finished yet
    assert _metric(llm_server, "rtserve_llm_generation_tokens_total") - generated < 16 * 300


def test_access_log_carries_token_counts(llm_server: RunningServer) -> None:
    status, headers, _ = _post(
        llm_server, "/v1/completions",
        {"model": MODEL, "prompt": "the cat sat", "max_tokens": 3, "ignore_eos": True},
    )  # fmt: skip
    assert status == 200
    deadline = time.monotonic() + 5
    pattern = re.compile(r"rtserve\.access: model=tiny .*prompt_tokens=\d+ completion_tokens=3\b")
    while not pattern.search(llm_server.log()):
        assert time.monotonic() < deadline, llm_server.log()[-2000:]
        time.sleep(0.05)


def test_trace_carries_token_counts(llm_server: RunningServer, otlp: OtlpReceiver) -> None:
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    body = json.dumps(
        {"model": MODEL, "prompt": "the cat", "max_tokens": 4, "ignore_eos": True}
    ).encode()
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    request = urllib.request.Request(f"{llm_server.base}/v1/completions", body, headers)
    with urllib.request.urlopen(request, timeout=30) as r:
        usage = json.loads(r.read())["usage"]
    deadline = time.monotonic() + 10
    while True:
        spans = [s for s in list(otlp.spans) if s.trace_id.hex() == trace_id]
        names = {s.name: s for s in spans}
        if "infer tiny" in names and "generate" in names:
            break
        assert time.monotonic() < deadline, [s.name for s in spans]
        time.sleep(0.05)
    root = names["infer tiny"]
    attributes = {a.key: a.value.int_value for a in root.attributes}
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == 4
    assert names["generate"].parent_span_id == root.span_id


# ---------------------------------------------------------------------- Triton generate
def _greedy_text(server: RunningServer, prompt: str, tokens: int) -> str:
    status, _, body = _post(
        server, "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
         "ignore_eos": True},
    )  # fmt: skip
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]  # type: ignore[no-any-return]


def test_triton_generate_and_generate_stream(llm_server: RunningServer) -> None:
    expected = _greedy_text(llm_server, "the dog", 7)
    request = {
        "text_input": "the dog",
        "parameters": {"max_tokens": 7, "temperature": 0, "ignore_eos": True},
    }
    status, _, body = _post(llm_server, f"/v2/models/{MODEL}/generate", request)
    assert status == 200
    assert json.loads(body) == {"model_name": MODEL, "model_version": "1", "text_output": expected}

    url = f"{llm_server.base}/v2/models/{MODEL}/versions/1/generate_stream"
    req = urllib.request.Request(url, json.dumps(request).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.read().split(b"\n\n") if e]
    docs = [json.loads(e.removeprefix(b"data: ")) for e in events]
    assert len(docs) >= 2 and all(d["model_name"] == MODEL for d in docs)
    assert "".join(d["text_output"] for d in docs) == expected

    status, _, body = _post(llm_server, f"/v2/models/{MODEL}/generate", {"text_input": 3})
    assert status == 400 and "text_input" in json.loads(body)["error"]
    status, _, body = _post(llm_server, "/v2/models/nope/generate", {"text_input": "a"})
    assert status == 404


# ---------------------------------------------------------------------- gRPC streaming
def _stream_client(server: RunningServer) -> tuple[Any, queue.Queue[Any]]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc)
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    return client, answers


def _text_input(text: str) -> Any:
    import tritonclient.grpc as grpcclient

    inp = grpcclient.InferInput("text_input", [1], "BYTES")
    inp.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return inp


def _collect(answers: queue.Queue[Any]) -> list[tuple[Any, bool]]:
    out = []
    while True:
        result, error = answers.get(timeout=30)
        assert error is None, error
        final = result.get_response().parameters["triton_final_response"].bool_param
        texts = result.as_numpy("text_output")
        out.append((None if texts is None else texts[0].decode(), final))
        if final:
            return out


def test_grpc_stream_infer_token_responses(llm_server: RunningServer) -> None:
    expected = _greedy_text(llm_server, "the bird", 6)
    client, answers = _stream_client(llm_server)
    try:
        params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        client.async_stream_infer(
            MODEL, [_text_input("the bird")], parameters=params, request_id="a",
            enable_empty_final_response=True,
        )  # fmt: skip
        got = _collect(answers)
        assert got[-1] == (None, True)  # the empty final response
        assert all(text and not final for text, final in got[:-1])
        assert "".join(text for text, _ in got[:-1]) == expected

        client.async_stream_infer(MODEL, [_text_input("the bird")], parameters=params)
        got = _collect(answers)  # without an empty final: the last text is flagged final
        assert got[-1][1] and got[-1][0] is not None
        assert "".join(text or "" for text, _ in got) == expected

        client.async_stream_infer(MODEL, [_text_input("the bird")], parameters={"max_tokens": -2})
        result, error = answers.get(timeout=30)
        assert result is None and "max_tokens" in str(error)
        client.async_stream_infer(MODEL, [_text_input("the bird")], parameters=params)
        assert "".join(text or "" for text, _ in _collect(answers)) == expected

        # Two generations at once on one stream: responses interleave, told apart by id.
        for rid in ("x", "y"):
            client.async_stream_infer(
                MODEL, [_text_input("the bird")], parameters=params, request_id=rid
            )
        texts = {"x": "", "y": ""}
        finals = set()
        while len(finals) < 2:
            result, error = answers.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            texts[response.id] += result.as_numpy("text_output")[0].decode()
            if response.parameters["triton_final_response"].bool_param:
                finals.add(response.id)
        assert texts == {"x": expected, "y": expected}
    finally:
        client.stop_stream()
        client.close()


def test_grpc_cancel_stops_the_sequence(llm_server: RunningServer) -> None:
    aborted = _metric(llm_server, "rtserve_llm_requests_finished_total", reason="abort")
    client, answers = _stream_client(llm_server)
    try:
        params = {"max_tokens": 500, "ignore_eos": True}
        client.async_stream_infer(MODEL, [_text_input("the cat")], parameters=params)
        for _ in range(3):
            result, error = answers.get(timeout=30)
            assert error is None
        client.stop_stream(cancel_requests=True)
        _wait_idle(llm_server)
        assert (
            _metric(llm_server, "rtserve_llm_requests_finished_total", reason="abort")
            == aborted + 1
        )
    finally:
        client.close()


# ---------------------------------------------------------------------- in-process Engine
async def _joined(events: Any) -> str:
    return "".join([event.text async for event in events])


def test_engine_generate(llm_repo: Path, llm_server: RunningServer) -> None:
    from rtserve.engine import Engine
    from rtserve.errors import InvalidInput

    expected = _greedy_text(llm_server, "the cat sat", 5)
    engine = Engine.from_repository(llm_repo)

    async def main() -> str:
        async with engine:
            pieces = []
            async for event in engine.generate(
                MODEL, "the cat sat", max_tokens=5, temperature=0, ignore_eos=True
            ):
                pieces.append(event.text)
            assert event.finish_reason == "length" and event.completion_tokens == 5
            with pytest.raises(InvalidInput, match="max_tokens"):
                async for _ in engine.generate(MODEL, "x", max_tokens=0):
                    pass
            with pytest.raises(InvalidInput, match="max_tokenz: not a sampling parameter"):
                async for _ in engine.generate(MODEL, "x", max_tokenz=2):
                    pass
            for bad in ("x", None, 1.5, True):  # (once, a string stopped the step loop)
                with pytest.raises(InvalidInput, match="priority: expected an integer"):
                    async for _ in engine.generate(MODEL, "x", max_tokens=2, priority=bad):
                        pass
            texts = await asyncio.gather(
                *(
                    _joined(engine.generate(MODEL, "the cat sat", max_tokens=3, priority=p))
                    for p in (0, 1, -1)
                )
            )
            assert all(texts) and engine.ready()
            return "".join(pieces)

    assert asyncio.run(main()) == expected
    with Engine.from_repository(llm_repo).sync() as sync_engine:
        events = list(sync_engine.generate(MODEL, messages=CHAT, max_tokens=3, ignore_eos=True))
        assert events[-1].finished and events[-1].completion_tokens == 3


def test_long_prompts_are_tokenized_off_the_loop_with_the_same_answers(
    llm_repo: Path, llm_server: RunningServer, tmp_path: Path
) -> None:
    """With the inline limit at 16 characters every prompt here takes the worker-thread
    path: OpenAI (whole, streamed and chat) and Triton generate answer as before."""
    prompt = "the cat sat on the mat"
    expected = _greedy_text(llm_server, prompt, 6)
    os.environ["RTSERVE_INLINE_PROMPT_CHARS"] = "16"
    try:
        server = start_server(llm_repo, tmp_path / "s")
    finally:
        del os.environ["RTSERVE_INLINE_PROMPT_CHARS"]
    try:
        assert _greedy_text(server, prompt, 6) == expected
        doc = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
               "ignore_eos": True, "stream": True}  # fmt: skip
        sock = connect(server.http_port)
        try:
            raw = json.dumps(doc).encode()
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (len(raw), raw)
            )
            head, body = _read_chunked(sock, bytearray())
        finally:
            sock.close()
        assert head.startswith("HTTP/1.1 200") and "text/event-stream" in head
        pieces = [
            json.loads(line[6:])["choices"][0]["text"]
            for line in body.decode().splitlines()
            if line.startswith("data: {")
        ]
        assert "".join(pieces) == expected
        request = {"text_input": prompt, "parameters": {"max_tokens": 6, "temperature": 0,
                   "ignore_eos": True}}  # fmt: skip
        status, _, body = _post(server, f"/v2/models/{MODEL}/generate", request)
        assert status == 200 and json.loads(body)["text_output"] == expected
        status, _, body = _post(server, "/v1/completions", {**doc, "prompt": "x" * 200_000})
        assert status == 400 and b"characters, expected at most" in body  # refused as before
        status, _, body = _post(
            server, "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3},
        )  # fmt: skip
        assert status == 200, body
    finally:
        server.stop()


def test_engine_tokenizes_long_prompts_on_a_worker_thread(
    llm_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from rtserve.core import generation
    from rtserve.engine import Engine
    from rtserve.runtime.llm.engine import LlmEngine

    threads: list[str] = []
    real = LlmEngine.encode_text

    def spy(self: LlmEngine, text: str) -> list[int]:
        threads.append(threading.current_thread().name)
        return real(self, text)

    monkeypatch.setattr(LlmEngine, "encode_text", spy)
    monkeypatch.setattr(generation, "INLINE_CHARS", 16)

    async def main() -> list[str]:
        async with Engine.from_repository(llm_repo) as engine:
            return [
                await _joined(engine.generate(MODEL, p, max_tokens=2, ignore_eos=True))
                for p in ("short", "a prompt over sixteen characters")
            ]

    texts = asyncio.run(main())
    assert all(texts)
    assert threads[0] == threading.current_thread().name  # short: on the loop
    assert threads[1] != threading.current_thread().name  # long: a worker thread


def test_a_client_gone_while_its_long_prompt_is_read_is_recorded(
    llm_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled during tokenization (worker thread): counted as a client error, as a
    client gone mid-generation is; too many long prompts at once are refused (503)."""
    import threading

    from rtserve.core import generation
    from rtserve.engine import Engine
    from rtserve.errors import Overloaded
    from rtserve.runtime.llm.engine import LlmEngine

    reading = threading.Event()
    real = LlmEngine.encode_text

    def slow(self: LlmEngine, text: str) -> list[int]:
        reading.set()
        time.sleep(0.5)
        return real(self, text)

    monkeypatch.setattr(LlmEngine, "encode_text", slow)
    monkeypatch.setattr(generation, "INLINE_CHARS", 16)

    def client_errors(engine: Engine) -> float:
        for line in engine.metrics_text().decode().splitlines():
            if line.startswith("rtserve_requests_total{") and 'outcome="client_error"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def main() -> tuple[float, float]:
        async with Engine.from_repository(llm_repo) as engine:
            before = client_errors(engine)
            task = asyncio.ensure_future(
                _joined(engine.generate(MODEL, "a prompt over sixteen characters", max_tokens=2))
            )
            while not reading.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            after = client_errors(engine)
            monkeypatch.setattr(generation, "MAX_READING", 0)
            with pytest.raises(Overloaded, match="long prompts are being read"):
                await _joined(engine.generate(MODEL, "another long prompt here", max_tokens=2))
            return before, after

    before, after = asyncio.run(main())
    assert after == before + 1


def test_chat_parts_are_bounded_and_a_long_chat_names_messages(llm_server: RunningServer) -> None:
    parts = [{"type": "text", "text": ""}] * 1025 + [{"type": "text", "text": "hi"}]
    doc = {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    status, _, body = _post(llm_server, "/v1/chat/completions", doc)
    assert status == 400 and b"messages[0].content: expected at most 1024 parts" in body
    long = " ".join(["the cat sat on the mat"] * 200)  # over max_model_len (512) tokens
    doc = {"model": MODEL, "messages": [{"role": "user", "content": long}], "max_tokens": 2}
    status, _, body = _post(llm_server, "/v1/chat/completions", doc)
    error = json.loads(body)["error"]
    assert (
        status == 400 and error["message"].startswith("messages: ") and "tokens" in error["message"]
    )


def test_grpc_stream_access_log_carries_the_request_id(llm_server: RunningServer) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(llm_server.grpc)
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(
        callback=lambda result, error: answers.put((result, error)),
        headers={"x-request-id": "grpc-stream-id-42"},
    )
    try:
        client.async_stream_infer(
            MODEL, [_text_input("the bird")], parameters={"max_tokens": 2, "ignore_eos": True}
        )
        assert _collect(answers)
    finally:
        client.stop_stream()
    deadline = time.monotonic() + 5
    while "request_id=grpc-stream-id-42" not in llm_server.log():
        assert time.monotonic() < deadline, llm_server.log()[-2000:]
        time.sleep(0.05)


def test_a_refused_request_counts_under_its_model(llm_server: RunningServer) -> None:
    before = _metric(llm_server, "rtserve_requests_total", model=MODEL, outcome="client_error")
    doc = {"model": MODEL, "prompt": "the cat", "max_tokens": 100_000}  # over max_model_len
    assert _post(llm_server, "/v1/completions", doc)[0] == 400
    after = _metric(llm_server, "rtserve_requests_total", model=MODEL, outcome="client_error")
    assert after == before + 1
