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
from rtserve.runtime.llm.params import GenerationEvent, TokenLogprob
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
    with pytest.raises(InvalidInput, match="stream_options: expected absent unless stream"):
        oa.parse_request(_chat(stream_options={"include_usage": True}), oa.CHAT)  # (as OpenAI)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"model": 5}, "model"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": []}, "stream_options"),
        ({"stream_options": {"include_usage": 1}, "stream": True}, "stream_options.include_usage"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": "f"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": "x"}, "logit_bias"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 1}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
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

    def __init__(
        self, texts: list[str], fail: bool = False, prompt: list[TokenLogprob] | None = None
    ) -> None:
        self.texts, self.fail, self.closed, self.prompt = texts, fail, False, prompt

    async def run(self) -> AsyncGenerator[GenerationEvent, None]:
        try:
            offset = 0
            for i, text in enumerate(self.texts):
                last = i == len(self.texts) - 1
                lp = [TokenLogprob(text, -0.5, [(text, -0.5), ("x", -2.0)], offset=offset)]
                offset += len(text)
                event = GenerationEvent(text, [i], 4, i + 1, "length" if last else None, lp)
                if i == 0:
                    event.prompt_logprobs = self.prompt
                yield event
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


PROMPT_LOGPROBS = [TokenLogprob("p", None), TokenLogprob("q", -1.5, [("r", -1.0)], offset=1)]


def test_complete_gathers_text_and_logprobs() -> None:
    """With echo, the prompt's tokens come first (the first one scored by nothing), and
    offsets are measured in the echoed text."""
    body = json.dumps({"model": "m", "prompt": "pq", "logprobs": 1, "echo": True}).encode()
    req = oa.parse_request(body, oa.TEXT)
    doc = asyncio.run(oa.complete(req, Events(["ab", "c"], prompt=PROMPT_LOGPROBS).run(), "pq"))
    choice = doc["choices"][0]
    assert choice["text"] == "pqabc" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["p", "q", "ab", "c"]
    assert lp["token_logprobs"] == [None, -1.5, -0.5, -0.5]
    assert lp["top_logprobs"] == [
        None,
        {"r": -1.0},
        {"ab": -0.5, "x": -2.0},
        {"c": -0.5, "x": -2.0},
    ]
    assert lp["text_offset"] == [0, 1, 2, 4]
    assert doc["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_echo_with_max_tokens_0_answers_the_prompt_scored() -> None:
    doc = {"model": "m", "prompt": "pq", "max_tokens": 0, "echo": True, "logprobs": 0}
    req = oa.parse_request(json.dumps(doc).encode(), oa.TEXT)
    assert req.score_only and req.params.max_tokens == 1  # (one token made, left out)
    out = asyncio.run(oa.complete(req, Events(["ab"], prompt=PROMPT_LOGPROBS).run(), "pq"))
    choice = out["choices"][0]
    assert choice["text"] == "pq" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["p", "q"]
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["total_tokens"] == 4
    req = oa.parse_request(json.dumps({**doc, "stream": True}).encode(), oa.TEXT)
    events = Events(["ab"], prompt=PROMPT_LOGPROBS)
    frames = _frames(asyncio.run(_all(oa.stream(req, events.run(), "pq"))))
    choices = [f["choices"][0] for f in frames[:-1]]
    assert "".join(c["text"] for c in choices) == "pq"
    assert choices[0]["logprobs"]["tokens"] == ["p", "q"] and choices[-1]["finish_reason"]
    for fields in ({"max_tokens": 0}, {"max_tokens": 0, "echo": False}):
        with pytest.raises(InvalidInput, match="^max_tokens: .*echo"):
            oa.parse_request(json.dumps({"model": "m", "prompt": "p", **fields}).encode(), oa.TEXT)


def test_streamed_echo_with_logprobs_sends_the_prompt_scored_first() -> None:
    body = {"model": "m", "prompt": "pq", "logprobs": 1, "echo": True, "stream": True}
    req = oa.parse_request(json.dumps(body).encode(), oa.TEXT)
    events = Events(["ab", "c"], prompt=PROMPT_LOGPROBS)
    frames = _frames(asyncio.run(_all(oa.stream(req, events.run(), "pq"))))
    choices = [f["choices"][0] for f in frames[:-1]]
    assert [c["text"] for c in choices] == ["pq", "ab", "c"]
    assert choices[0]["logprobs"]["text_offset"] == [0, 1]
    assert [c["logprobs"]["text_offset"] for c in choices[1:]] == [[2], [4]]


def test_chat_logprob_bytes_are_the_tokens_own() -> None:
    """Part of a character: the text reads U+FFFD, the bytes are the token's; completions'
    top alternatives that read the same keep the most likely."""
    split = TokenLogprob(
        "\ufffd", -0.1, [("\ufffd", -0.1), ("\ufffd", -3.0)], b"\xf0\x9f", [b"\xf0\x9f", b"\xe2"]
    )
    req = oa.parse_request(_chat(logprobs=True, top_logprobs=2), oa.CHAT)
    entry = oa.Shaper(req).chunk("", [split], None)["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "\ufffd" and entry["bytes"] == [0xF0, 0x9F]
    assert [t["bytes"] for t in entry["top_logprobs"]] == [[0xF0, 0x9F], [0xE2]]
    req = oa.parse_request(
        json.dumps({"model": "m", "prompt": "p", "logprobs": 2}).encode(), oa.TEXT
    )
    lp = oa.Shaper(req).chunk("", [split], None)["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{"\ufffd": -0.1}]
