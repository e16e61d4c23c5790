"""The OpenAI-compatible API over a generative model, without a transport: request parsing
(``parse_request``), answers (``complete``), server-sent events (``stream``) and errors in
OpenAI's shape (``error_answer``). The HTTP server, the Ray deployment and the serverless
handler share it, so that the official ``openai`` client works against each unchanged.

What is served: ``/v1/chat/completions`` and ``/v1/completions`` (one choice, ``n`` 1),
streamed (``data: {...}`` events, then ``data: [DONE]``; ``stream_options.include_usage``
adds a last chunk with the token counts) or not (with ``usage``), with ``logprobs``;
``/v1/models``. A request field rtserve cannot honour (tools, penalties, a logit bias, ...)
is refused naming it, never silently ignored.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from rtserve.errors import InvalidInput, ModelNotFound, Overloaded, as_error
from rtserve.runtime.llm import chat
from rtserve.runtime.llm.params import GenerationEvent, SamplingParams, TokenLogprob, not_neutral
from rtserve.server import structured
from rtserve.server.errors import http_error
from rtserve.server.tools import CallStream, ToolChoice, call_schema, parse_calls, parse_tools

Headers = list[tuple[bytes, bytes]]
CHAT, TEXT, RESPONSES = "chat", "text", "responses"
SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies (nginx) must not hold events back
]
DONE = b"data: [DONE]\n\n"
# A field the engine cannot honour, and the value that means "not used" (sampling fields
# are checked with the sampling parameters: ``llm.params.NOT_HONOURED``).
_UNUSED: dict[str, Any] = {
    "functions": None,
    "function_call": "none",
    "suffix": None,
    "best_of": 1,
    "audio": None,
    "prediction": None,
    "modalities": ["text"],
}
_NOT_SAMPLING = frozenset((*structured.FIELDS, "tools", "tool_choice", "parallel_tool_calls"))
_FIELD = re.compile(r"([A-Za-z_]\w*(?:\[\d+\])?(?:\.[A-Za-z_]\w*(?:\[\d+\])?)*): ")
# The chat fields a Responses request's own fields are read as (error messages name the latter).
_RESPONSES_FIELDS = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens"}


@dataclass(slots=True)
class OpenAIRequest:
    """A checked chat (``messages``) or completions (``prompt``) request."""

    kind: str
    model: str
    params: SamplingParams
    messages: list[Any] | None = None
    prompt: str | list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    priority: int = 0
    score_only: bool = False  # echo with max_tokens 0: the prompt, scored, and no answer
    n: int = 1
    tools: ToolChoice | None = None
    # The output's constraint as (kind, spec) (``structured.py``); None: free text.
    constraint: tuple[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # (RESPONSES: fields it repeats)


def _fail(field: str, expected: str, value: Any) -> InvalidInput:
    return InvalidInput(f"{field}: expected {expected}, got {repr(value)[:60]}")


def json_object(body: bytes, expected: str) -> dict[str, Any]:
    """A request body that must be a JSON object (``expected``: what the error says)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidInput("request body: not valid JSON") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"request body: expected {expected}")
    return doc


def parse_request(body: bytes, kind: str) -> OpenAIRequest:
    """The request in ``body`` (``kind``: CHAT or TEXT; RESPONSES: ``responses.parse``); raises ``InvalidInput``
    naming the field and what was expected. Messages are checked when encoded (the chat
    template)."""
    return parse_document(json_object(body, "a JSON object"), kind)


def parse_document(doc: dict[str, Any], kind: str) -> OpenAIRequest:
    """:func:`parse_request` of a parsed body (CHAT or TEXT)."""
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("model", "the name of a served model (a string)", model)
    _check_unused(doc)
    tools = parse_tools(doc) if kind == CHAT else None
    if kind == TEXT and doc.get("tools"):
        raise _fail("tools", "absent in a completions request (tools are for chat)", doc["tools"])
    constraint = structured.parse(doc)
    if tools is not None and tools.constrained:
        if constraint is not None:
            raise _fail(
                "response_format",
                f"absent with tool_choice {tools.mode} (the answer is the tool call)",
                doc.get("response_format"),
            )
        constraint = (structured.JSON_SCHEMA, call_schema(tools))
    stream = _flag(doc, "stream")
    options = doc.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _fail("stream_options", "an object such as {include_usage: true}", options)
    if options is not None and not stream:
        raise _fail("stream_options", "absent unless stream is true", options)
    include_usage = (
        stream and options is not None and _flag(options, "include_usage", "stream_options.")
    )
    priority = doc.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise _fail("priority", "an integer", priority)
    # Completions' echo with max_tokens 0 scores the prompt (lm-evaluation-harness): one
    # token is generated and left out of the answer, as vLLM does.
    score_only = kind == TEXT and type(doc.get("max_tokens")) is int and doc["max_tokens"] == 0
    if score_only and not _flag(doc, "echo"):
        raise _fail("max_tokens", "an integer >= 1 (0 only with echo: the prompt scored)", 0)
    request = OpenAIRequest(
        kind,
        model,
        # A chat without max_tokens stops at llm.default_max_tokens or the context's end
        # (core/generation.py); completions take OpenAI's 16 tokens.
        structured.attach(
            SamplingParams.from_mapping(
                _sampling_fields(doc, score_only), default_max_tokens=None if kind == CHAT else 16
            ),
            constraint,
        ),
        stream=stream,
        include_usage=include_usage,
        priority=priority,
        tools=tools,
        constraint=constraint,
    )
    request.n = _choices(request.params, doc)
    if kind == CHAT:
        if "messages" not in doc:
            raise InvalidInput("messages: expected a non-empty list of {role, content} objects")
        request.messages = chat.Messages.of(doc["messages"], tools.offered if tools else None)
    else:
        request.prompt = _prompt(doc.get("prompt"))
        request.echo = _flag(doc, "echo")
        request.score_only = score_only
    return request


def _flag(doc: dict[str, Any], key: str, where: str = "") -> bool:
    value = doc.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _fail(where + key, "true or false", value)
    return value


def _check_unused(doc: dict[str, Any]) -> None:
    used = not_neutral(doc, _UNUSED)
    if used is not None:
        key, expected = used
        raise _fail(key, f"{expected} (not supported by rtserve)", doc[key])


def _sampling_fields(doc: dict[str, Any], score_only: bool) -> dict[str, Any]:
    """The body's fields less those read here (structured outputs, tools)."""
    fields = {k: v for k, v in doc.items() if k not in _NOT_SAMPLING}
    if score_only:
        fields["max_tokens"] = 1
    return fields


def _choices(params: SamplingParams, doc: dict[str, Any]) -> int:
    """How many choices to answer (``n``, read and bounded by the sampling parameters)."""
    n = getattr(params, "n", None)
    if n is None:  # (an engine without n: one choice)
        value = doc.get("n")
        if value is not None and value != 1:
            raise _fail("n", "1 (this build answers one choice per request)", value)
        return 1
    return int(n)


def _prompt(value: Any) -> str | list[int]:
    """A completions prompt: text, token ids, or a list holding exactly one of those."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    raise _fail(
        "prompt", "one non-empty string or list of token ids (one prompt per request)", value
    )


# ---------------------------------------------------------------------- answers
class Shaper:
    """Builds one request's answer documents (ids, timestamps and field names as OpenAI's)."""

    def __init__(self, request: OpenAIRequest) -> None:
        self.request = request
        chat = request.kind == CHAT
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _doc(self, chunk: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        if self.request.kind == CHAT:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
        }

    def chunk(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish: str | None,
        role: bool = False,
        index: int = 0,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.request.kind == CHAT:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or not tool_calls:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs)
        choice["finish_reason"] = finish
        doc = self._doc(True, [choice])
        if self.request.include_usage:
            doc["usage"] = None
        return doc

    def usage_chunk(self, lasts: list[GenerationEvent | None]) -> dict[str, Any]:
        doc = self._doc(True, [])
        doc["usage"] = usage_of(lasts)
        return doc

    def choice(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        last: GenerationEvent | None,
    ) -> dict[str, Any]:
        """One choice of a whole answer (tool calls read from a chat's text)."""
        finish = _finish_reason(last)
        choice: dict[str, Any] = {"index": index}
        if self.request.kind == CHAT:
            content, calls = parse_calls(text, self.request.tools)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls"
            choice["message"] = message
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs)
        choice["finish_reason"] = finish
        return choice

    def response(
        self, choices: list[dict[str, Any]], lasts: list[GenerationEvent | None]
    ) -> dict[str, Any]:
        doc = self._doc(False, choices)
        doc["usage"] = usage_of(lasts)
        return doc

    def _logprobs(self, items: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if items is None or self.request.params.logprobs is None:
            return None
        if self.request.kind == CHAT:
            return {"content": [_chat_logprob(t) for t in items]}
        return {
            "tokens": [t.token for t in items],
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [_top_by_text(t) for t in items],
            "text_offset": [t.offset for t in items],
        }


def _top_by_text(t: TokenLogprob) -> dict[str, float] | None:
    """Completions' ``{text: logprob}`` of the alternatives; of those whose text reads the
    same (parts of characters, U+FFFD), the most likely. None for a prompt's first token."""
    if t.logprob is None:
        return None
    top: dict[str, float] = {}
    for token, logprob in t.top:
        top.setdefault(token, logprob)
    return top


def _chat_logprob(t: TokenLogprob) -> dict[str, Any]:
    def one(token: str, logprob: float | None, raw: bytes | None) -> dict[str, Any]:
        data = token.encode() if raw is None else raw
        return {"token": token, "logprob": logprob, "bytes": list(data)}

    entry = one(t.token, t.logprob, t.raw)
    raws = t.top_raw if t.top_raw is not None else [None] * len(t.top)
    entry["top_logprobs"] = [one(tok, lp, raw) for (tok, lp), raw in zip(t.top, raws, strict=True)]
    return entry


def _shifted(items: list[TokenLogprob] | None, chars: int) -> list[TokenLogprob] | None:
    """``items`` with their text offsets moved ``chars`` on (past an echoed prompt)."""
    if not chars or not items:
        return items
    return [replace(t, offset=t.offset + chars) for t in items]


def _scored(last: GenerationEvent | None) -> GenerationEvent | None:
    """The last event of a prompt scored without an answer (``echo``, ``max_tokens`` 0):
    the token generated to get there is not counted."""
    return None if last is None else replace(last, completion_tokens=0, finish_reason="length")


def _finish_reason(last: GenerationEvent | None) -> str:
    return "stop" if last is None or last.finish_reason is None else last.finish_reason


def usage(last: GenerationEvent | None) -> dict[str, Any]:
    return usage_of([last])


def usage_of(lasts: list[GenerationEvent | None]) -> dict[str, Any]:
    """The token counts of a request's choices (the prompt counted once)."""
    first = next((e for e in lasts if e is not None), None)
    prompt = first.prompt_tokens if first is not None else 0
    completion = sum(e.completion_tokens for e in lasts if e is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens if first else 0},
    }


async def check_constraint(llm: Any, request: OpenAIRequest) -> None:
    """Compile the request's constraint (cached by the engine) before an answer starts, so
    that a schema the grammar engine cannot use is a 400, not an error event."""
    check = getattr(llm, "check_constraint", None)
    if request.constraint is not None and check is not None:
        await check(request.params)


def choice_index(event: GenerationEvent) -> int:
    """Which choice an event belongs to (0 with ``n`` 1)."""
    return int(getattr(event, "index", 0) or 0)


async def complete(
    request: OpenAIRequest, events: AsyncGenerator[GenerationEvent, None], prompt_text: str = ""
) -> dict[str, Any]:
    """The whole answer (``chat.completion`` / ``text_completion``) once generation ends;
    ``prompt_text``: what ``echo`` puts before the completion."""
    shaper = Shaper(request)
    n = request.n
    texts: list[list[str]] = [[prompt_text] if request.echo else [] for _ in range(n)]
    base = len(prompt_text) if request.echo else 0
    scoring = request.params.logprobs is not None
    logprobs: list[list[TokenLogprob] | None] = [[] if scoring else None for _ in range(n)]
    lasts: list[GenerationEvent | None] = [None] * n
    async with aclosing(events):
        async for event in events:
            i = choice_index(event)
            lasts[i] = event
            items = logprobs[i]
            if items is not None and event.prompt_logprobs:  # (first, when echoed)
                items.extend(event.prompt_logprobs)
            if request.score_only:
                continue
            texts[i].append(event.text)
            if items is not None and event.logprobs:
                items.extend(_shifted(event.logprobs, base) or ())
    if request.score_only:
        lasts = [_scored(last) for last in lasts]
    choices = [shaper.choice(i, "".join(texts[i]), logprobs[i], lasts[i]) for i in range(n)]
    return shaper.response(choices, lasts)


def sse(doc: Any) -> bytes:
    """One server-sent event carrying ``doc`` as JSON."""
    return b"data: " + orjson.dumps(doc) + b"\n\n"


async def stream(
    request: OpenAIRequest, events: AsyncGenerator[GenerationEvent, None], prompt_text: str = ""
) -> AsyncGenerator[bytes, None]:
    """The answer as server-sent events: chunks as tokens come (each choice's with its
    ``index``), the usage chunk when asked for, then ``[DONE]``. Text that may be a tool
    call is held back and sent as ``delta.tool_calls`` when the choice ends. A failure
    after the stream began is sent as an error event (the status line has gone out).
    Closing this iterator closes ``events`` (aborting them)."""
    shaper = Shaper(request)
    chat = request.kind == CHAT
    n = request.n
    base = len(prompt_text) if request.echo else 0
    # An echo with logprobs waits for the prompt's, which come with the first event.
    echo_scored = [request.echo and request.params.logprobs is not None] * n
    calls = [CallStream(request.tools) for _ in range(n)]
    lasts: list[GenerationEvent | None] = [None] * n
    async with aclosing(events):
        try:
            for i in range(n):
                if chat:
                    yield sse(shaper.chunk("", None, None, role=True, index=i))
                elif request.echo and not echo_scored[i]:
                    yield sse(shaper.chunk(prompt_text, None, None, index=i))
            async for event in events:
                i = choice_index(event)
                lasts[i] = event
                if echo_scored[i]:
                    echo_scored[i] = False
                    yield sse(shaper.chunk(prompt_text, event.prompt_logprobs or [], None, index=i))
                if request.score_only:
                    if event.finished:
                        lasts[i] = _scored(event)
                        yield sse(shaper.chunk("", None, "length", index=i))
                    continue
                text = calls[i].feed(event.text) if chat else event.text
                finish = event.finish_reason
                found: list[dict[str, Any]] = []
                if finish is not None and chat:
                    tail, found = calls[i].finish()
                    text += tail
                    if found:
                        finish = "tool_calls"
                if text or finish or event.logprobs or found:
                    lps = _shifted(event.logprobs, base)
                    yield sse(shaper.chunk(text, lps, finish, index=i, tool_calls=found))
            if request.include_usage:
                yield sse(shaper.usage_chunk(lasts))
        except Exception as exc:
            yield sse(error_document(exc, request.kind)[1])
    yield DONE


# ---------------------------------------------------------------------- errors
def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable_error"
    return "invalid_request_error"


def error_document(exc: BaseException, kind: str = TEXT) -> tuple[int, dict[str, Any]]:
    """(status, ``{"error": {message, type, param, code}}``) of a failed request. ``param``
    is the field the message names first (a prompt counts as ``messages`` in a chat)."""
    err = as_error(exc, "generation request")
    status = err.http_status
    match = _FIELD.match(err.message)
    param = match.group(1) if match else None
    message = err.message
    if kind == CHAT and param == "prompt":
        param = "messages"
    elif kind == RESPONSES and param in _RESPONSES_FIELDS:
        # (a Responses field read as a chat one: the message names the field it was sent as)
        message = _RESPONSES_FIELDS[param] + message[len(param) :]
        param = _RESPONSES_FIELDS[param]
    code: str | None = None
    if isinstance(err, ModelNotFound):
        param, code = "model", "model_not_found"
    elif status == 429:
        code = "rate_limit_exceeded"
    elif isinstance(err, Overloaded):
        code = "overloaded"
    body = {"message": message, "type": _error_type(status), "param": param, "code": code}
    return status, {"error": body}


def error_answer(exc: BaseException, kind: str = TEXT) -> tuple[int, bytes, Headers]:
    """(status, body, headers) of a failed request in OpenAI's shape; ``Retry-After`` with
    a refusal under load (429 / 503), as every rtserve refusal carries it."""
    status, doc = error_document(exc, kind)
    _, _, headers = http_error(as_error(exc, "generation request"))
    return status, orjson.dumps(doc), headers


# ---------------------------------------------------------------------- models
def models_document(models: Iterable[tuple[str, int, int]]) -> dict[str, Any]:
    """``/v1/models`` of (name, created unix time, max_model_len) entries."""
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "rtserve",
                "max_model_len": max_len,
            }
            for name, created, max_len in models
        ],
    }
