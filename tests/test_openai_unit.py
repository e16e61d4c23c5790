"""``server/openai.py`` without a server: request parsing, error documents and the event
stream's framing (what the Ray and serverless adapters reuse). End-to-end checks with the
official client are in ``test_llm_api.py``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from rtserve.errors import InvalidInput, ModelNotFound, ObjectiveRefused, Overloaded
from rtserve.llm.params import GenerationEvent, TokenLogprob
from rtserve.server import openai as oa


def _chat(**fields: Any) -> bytes:
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(doc).encode()


def test_chat_defaults_and_stream_options() -> None:
    req = oa.parse_request(_chat(), oa.CHAT)
    assert req.model == "m" and req.messages and not req.stream
    assert req.params.max_tokens is None  # a chat runs to the model's length by default
    req = oa.parse_request(_chat(stream=True, stream_options={"include_usage": True}), oa.CHAT)
    assert req.stream and req.include_usage
    req = oa.parse_request(_chat(stream_options={"include_usage": True}), oa.CHAT)
    assert not req.include_usage  # usage chunks only exist in a stream


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 3}, "n"),
        ({"model": 5}, "model"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": []}, "stream_options"),
        ({"stream_options": {"include_usage": 1}, "stream": True}, "stream_options.include_usage"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [1]}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ],
)
def test_bad_chat_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidInput) as info:
        oa.parse_request(_chat(**fields), oa.CHAT)
    status, doc = oa.error_document(info.value, oa.CHAT)
    assert status == 400 and doc["error"]["param"] == param
    assert doc["error"]["type"] == "invalid_request_error"


def test_completion_prompts() -> None:
    body = json.dumps({"model": "m", "prompt": ["one"]}).encode()
    req = oa.parse_request(body, oa.TEXT)
    assert req.prompt == "one" and req.params.max_tokens == 16
    req = oa.parse_request(json.dumps({"model": "m", "prompt": [[5, 6]]}).encode(), oa.TEXT)
    assert req.prompt == [5, 6]
    for prompt in (["a", "b"], "", [], None, [1.5]):
        with pytest.raises(InvalidInput, match="^prompt: "):
            oa.parse_request(json.dumps({"model": "m", "prompt": prompt}).encode(), oa.TEXT)
    with pytest.raises(InvalidInput, match="not valid JSON"):
        oa.parse_request(b"{", oa.TEXT)
    with pytest.raises(InvalidInput, match="JSON object"):
        oa.parse_request(b"[]", oa.TEXT)


def test_error_documents() -> None:
    status, doc = oa.error_document(InvalidInput("prompt: too long"), oa.CHAT)
    assert status == 400 and doc["error"]["param"] == "messages"  # a chat's prompt
    _, doc = oa.error_document(InvalidInput("request body: not valid JSON"))
    assert doc["error"]["param"] is None
    status, doc = oa.error_document(ModelNotFound("unknown model 'x'"))
    assert status == 404 and doc["error"]["code"] == "model_not_found"
    status, body, headers = oa.error_answer(ObjectiveRefused("too slow", retry_after_s=2.4))
    assert status == 429 and (b"retry-after", b"2") in headers
    assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
    status, body, headers = oa.error_answer(Overloaded("12 requests waiting", retry_after_s=1))
    assert status == 503 and (b"retry-after", b"1") in headers
    assert json.loads(body)["error"]["type"] == "service_unavailable_error"
    status, doc = oa.error_document(RuntimeError("boom"))
    assert status == 500 and doc["error"]["type"] == "server_error"
    assert "boom" not in doc["error"]["message"]  # a bug's details stay in the log


class Events:
    """Generation events as the engine yields them, recording whether it was closed."""

    def __init__(self, texts: list[str], fail: bool = False) -> None:
        self.texts, self.fail, self.closed = texts, fail, False

    async def run(self) -> AsyncGenerator[GenerationEvent, None]:
        try:
            for i, text in enumerate(self.texts):
                last = i == len(self.texts) - 1
                lp = [TokenLogprob(text, -0.5, [(text, -0.5), ("x", -2.0)])]
                yield GenerationEvent(text, [i], 4, i + 1, "length" if last else None, lp)
            if self.fail:
                raise InvalidInput("stop: something went wrong")
        finally:
            self.closed = True


def _frames(chunks: list[bytes]) -> list[Any]:
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
    return [c[6:-2] if c == oa.DONE else json.loads(c[6:]) for c in chunks]


async def _all(gen: AsyncGenerator[bytes, None]) -> list[bytes]:
    return [chunk async for chunk in gen]


def test_stream_frames_usage_and_done() -> None:
    req = oa.parse_request(
        _chat(stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=1),
        oa.CHAT,
    )
    events = Events(["Hel", "lo"])
    frames = _frames(asyncio.run(_all(oa.stream(req, events.run()))))
    assert frames[-1] == b"[DONE]" and events.closed
    first, *middle, usage = frames[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [f["choices"][0]["delta"]["content"] for f in middle] == ["Hel", "lo"]
    assert middle[-1]["choices"][0]["finish_reason"] == "length"
    top = middle[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert top[0] == {"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel")}
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 6
    assert len({f["id"] for f in frames[:-1]}) == 1


def test_stream_failure_is_an_error_event() -> None:
    req = oa.parse_request(
        json.dumps({"model": "m", "prompt": "a", "stream": True}).encode(), oa.TEXT
    )
    frames = _frames(asyncio.run(_all(oa.stream(req, Events(["a"], fail=True).run()))))
    assert frames[-1] == b"[DONE]"
    assert frames[-2]["error"]["param"] == "stop"


def test_closing_the_stream_closes_the_generation() -> None:
    """A client that went away closes the SSE iterator; the generation must close too."""
    req = oa.parse_request(_chat(stream=True), oa.CHAT)
    events = Events(["a", "b", "c", "d"])

    async def main() -> None:
        stream = oa.stream(req, events.run())
        await stream.__anext__()
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(main())
    assert events.closed


def test_complete_gathers_text_and_logprobs() -> None:
    body = json.dumps({"model": "m", "prompt": "p", "logprobs": 1, "echo": True}).encode()
    req = oa.parse_request(body, oa.TEXT)
    doc = asyncio.run(oa.complete(req, Events(["ab", "c"]).run(), "p"))
    choice = doc["choices"][0]
    assert choice["text"] == "pabc" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["ab", "c"]
    assert choice["logprobs"]["text_offset"] == [0, 2]
    assert doc["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
