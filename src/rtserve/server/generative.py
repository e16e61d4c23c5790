"""The generative routes of the application (``rtserve.api``): the OpenAI-compatible API
(``/v1/...``, see ``server/openai.py``) and Triton's generate extension
(``/v2/models/{m}/generate`` and ``generate_stream``); each is a method that the route table
(``api/routes.py``) names.

Each request is parsed and checked first (``core/generation.prepare``: model, prompt,
length, the first-token objective), so a refusal is a plain error answer; then the
answer is streamed as server-sent events or gathered and sent whole. ``GenerativeRoutes.reply``
does all of that without a transport; each adapter sends its ``Reply`` its own way. A client
that goes away stops its sequence: the stream's iterator is closed, or the task gathering
the answer is cancelled.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import orjson

from rtserve.api.call import Answer, Call, Pending, Reply, Streamed, gather, settle
from rtserve.api.context import timings_of, with_request_id
from rtserve.core import generation
from rtserve.core.dataplane import DataPlane
from rtserve.errors import InvalidInput, ModelNotFound, PayloadTooLarge, RouteNotFound
from rtserve.protocol.limits import DEFAULT_LIMITS
from rtserve.protocol.types import Timings
from rtserve.runtime.llm.params import GenerationEvent, SamplingParams
from rtserve.server import embeddings, openai, responses
from rtserve.server.errors import JSON_TYPE, http_error
from rtserve.server.security import Guard, http_credential

__all__ = ["Answer", "GenerativeRoutes", "Pending", "Reply", "Streamed", "gather", "settle"]
_GENERATE = ("generate", "generate_stream")
# Triton generate: request keys that are not sampling parameters.
_TRITON_KEYS = ("text_input", "parameters", "id", "stream")
# What a generative request body may cost to parse, checked before it is parsed (the JSON
# parser holds the GIL: no thread keeps a large parse from stalling the event loop). The
# body: at most BODY_BYTES_PER_TOKEN bytes per token of the longest max_model_len served
# (escaped text, token ids), at least MIN_BODY_BYTES; lists and objects: V2's
# max_json_containers; items (commas): one per token, and MIN_ITEMS more (fields, stop strings).
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 1 << 20
MAX_JSON_CONTAINERS = DEFAULT_LIMITS.max_json_containers
MIN_ITEMS = 1 << 14
# The top-level "model" of a body, found without parsing it (when it is the only one).
_MODEL_KEY = re.compile(rb'"model"\s*:\s*"([^"\\]{1,1024})"')
# A generative route: a method of GenerativeRoutes taking (request, peer, inflated body).
Route = Callable[["GenerativeRoutes", Call, str, bytes], Reply]


def is_generative_route(path: str) -> bool:
    """Whether ``path`` (canonical) is one of these routes (checked after ``/infer``)."""
    return path.startswith("/v1/") or path.endswith(("/generate", "/generate_stream"))


def _generate_target(path: str) -> tuple[str, str, bool]:
    """(model, version, streamed) of ``/v2/models/{m}[/versions/{v}]/generate[_stream]``."""
    parts = path.split("/")
    n = len(parts)
    if n == 5 and parts[1:3] == ["v2", "models"] and parts[4] in _GENERATE:
        return parts[3], "", parts[4] == "generate_stream"
    if (
        n == 7
        and parts[1:3] == ["v2", "models"]
        and parts[4] == "versions"
        and parts[6] in _GENERATE
    ):
        return parts[3], parts[5], parts[6] == "generate_stream"
    raise RouteNotFound(f"no route for POST {path[:200]}")


class GenerativeRoutes:
    """The generative routes over a dataplane, without a transport."""

    def __init__(
        self,
        dataplane: DataPlane,
        guard: Guard | None = None,
        decompress: Callable[[bytes, bytes], bytes] | None = None,
    ) -> None:
        """``decompress``: the application's (``Application.decompress``: gzip and deflate
        up to ``max_decompressed_bytes``, other encodings refused); None: a body with a
        Content-Encoding other than identity is refused."""
        self.dataplane = dataplane
        self.guard = guard
        self.decompress = decompress
        self.started = int(time.time())

    def reply(self, request: Call, peer: str = "", route: Route | None = None) -> Reply:
        """The reply to one request on these routes, for any transport (``peer``: the
        client's address, whose share a generation counts in without keys); ``route``: the
        method answering it (``GenerativeRoutes.route`` by default) with its inflated body."""
        route = route or GenerativeRoutes.route
        encoding = request.headers.get(b"content-encoding")
        if request.method == b"POST" and encoding is not None and encoding.lower() != b"identity":
            return self._inflated(request, encoding.lower(), peer, route)
        return route(self, request, peer, request.body)

    def route(self, request: Call, peer: str, body: bytes) -> Reply:
        """Any of these routes, by its path (for callers outside the route table)."""
        path = request.path
        method = b"GET" if request.method == b"HEAD" else request.method
        if path in ("/v1/chat/completions", "/v1/completions") and method == b"POST":
            return self.completions(request, peer, body)
        if path == "/v1/models" and method == b"GET":
            return self.models(request, peer, body)
        if path.startswith("/v1/models/") and method == b"GET":
            return self.model(request, peer, body)
        if path.startswith("/v1/"):
            return self.unknown(request, peer, body)
        return self.triton(request, peer, body)

    def completions(self, request: Call, peer: str, body: bytes) -> Reply:
        """``POST /v1/chat/completions`` and ``/v1/completions``."""
        kind = openai.CHAT if "chat" in request.path else openai.TEXT
        return self._openai(request, kind, peer, body)

    def responses(self, request: Call, peer: str, body: bytes) -> Reply:
        """``POST /v1/responses`` (``server/responses.py``)."""
        return self._openai(request, openai.RESPONSES, peer, body)

    def embeddings(self, request: Call, peer: str, body: bytes) -> Reply:
        """``POST /v1/embeddings`` (``server/embeddings.py``)."""
        return embeddings.reply(self.dataplane, self.guard, request, body)

    def models(self, request: Call, peer: str, body: bytes) -> Reply:
        """``GET /v1/models``."""
        return 200, orjson.dumps(self._models(request)), [JSON_TYPE]

    def model(self, request: Call, peer: str, body: bytes) -> Reply:
        """``GET /v1/models/{name}``."""
        return self._model(request, request.path[len("/v1/models/") :])

    def unknown(self, request: Call, peer: str, body: bytes) -> Reply:
        """Any other ``/v1`` request: 404 in OpenAI's shape."""
        method = b"GET" if request.method == b"HEAD" else request.method
        return openai.error_answer(
            RouteNotFound(f"no route for {method.decode()} {request.path[:200]}")
        )

    def triton(self, request: Call, peer: str, body: bytes) -> Reply:
        """``/v2/models/{m}[/versions/{v}]/generate[_stream]``."""
        return self._triton(request, peer, body)

    def _inflated(self, request: Call, encoding: bytes, peer: str, route: Route) -> Pending:
        """The reply to a compressed body, inflated on a thread as V2 inflates (zlib lets
        the event loop run meanwhile), then checked and answered as any other body."""

        async def answer() -> Answer | Streamed:
            try:
                if self.decompress is None:
                    raise InvalidInput(
                        f"Content-Encoding: {encoding[:40].decode(errors='replace')!r} is not "
                        "supported here (expected identity)"
                    )
                self.check_body_size(len(request.body))
                body = await asyncio.to_thread(self.decompress, request.body, encoding)
            except Exception as exc:
                if request.path.startswith("/v1/"):
                    kind = openai.CHAT if "chat" in request.path else openai.TEXT
                    return openai.error_answer(exc, kind)
                return http_error(exc)
            return await settle(route(self, request, peer, body))

        return Pending(answer)

    # ------------------------------------------------------------------ body limits
    def _longest(self) -> int:
        """The longest ``max_model_len`` of the generative models served (0: none)."""
        engines = map(generation.engine_of, self.dataplane.registry.loaded_versions())
        lengths = [llm.max_model_len for llm in engines if llm is not None]
        return max(lengths, default=0)

    def body_limit(self) -> int:
        """The largest request body these routes read (bytes, inflated)."""
        return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * self._longest())

    def check_body_size(self, size: int) -> None:
        limit = self.body_limit()
        if size > limit:
            raise PayloadTooLarge(
                f"request body: {size} bytes, over the limit of {limit} for generation "
                f"({BODY_BYTES_PER_TOKEN} bytes per token of max_model_len, at least "
                f"{MIN_BODY_BYTES})"
            )

    def check_body(self, body: bytes) -> None:
        """Refuse a body that would cost more to parse than a request can need: its size,
        its lists and objects, its items (every ``[``, ``{`` and ``,`` counts, in strings
        too), each error naming the limit."""
        self.check_body_size(len(body))
        if len(body) <= MIN_ITEMS:  # (too short to hold more than the limits)
            return
        containers = body.count(b"[") + body.count(b"{")
        if containers > MAX_JSON_CONTAINERS:
            raise PayloadTooLarge(
                f"request body: more than {MAX_JSON_CONTAINERS} lists and objects "
                f"('[' and '{{', {containers}) (max_json_containers)"
            )
        items = body.count(b",")
        limit = self._longest() + MIN_ITEMS
        if items > limit:
            raise PayloadTooLarge(
                f"request body: {items} items (commas), over the limit of {limit} for "
                f"generation (max_model_len and {MIN_ITEMS} more)"
            )

    def _authorize_early(self, raw: Call, body: bytes) -> None:
        """The key checked for the model a body names before the body is parsed, when that
        can be read without parsing (one ``"model"`` key); the parsed request is checked
        again."""
        if self.guard is None or body.count(b'"model"') != 1:
            return
        found = _MODEL_KEY.search(body)
        if found is not None:
            self.guard.http_model(raw.headers, found.group(1).decode("utf-8", "replace"))

    def _client(self, raw: Call, peer: str) -> dict[str, Any]:
        """Whose fair share a generation counts in (its key's name; without keys, the
        client's address) and the most urgent priority its key is granted."""
        auth = self.guard.auth if self.guard is not None else None
        if auth is None:
            return {"tenant": peer}
        grant = auth.grant(http_credential(raw.headers))  # (as the guard found it)
        return {"tenant": grant.name, "min_priority": grant.min_priority}

    # ------------------------------------------------------------------ OpenAI
    def _openai(self, raw: Call, kind: str, peer: str, body: bytes) -> Reply:
        dp = self.dataplane
        timings = Timings(received=raw.received_ns)
        model = ""
        try:
            timings = timings_of(raw.headers, raw.received_ns)
            self.check_body(body)
            self._authorize_early(raw, body)
            request = (
                responses.parse(openai.json_object(body, "a JSON object"))
                if kind == openai.RESPONSES
                else openai.parse_request(body, kind)
            )
            model = request.model
            if self.guard is not None:
                self.guard.http_model(raw.headers, model)
            asked = {**_asked(request, timings), **self._client(raw, peer)}
            if not generation.inline(request.prompt, request.messages):
                return _prepared_later(
                    lambda: generation.prepare_async(dp, model, timings, request.params, **asked),
                    lambda gen: self._openai_reply(request, kind, timings, gen),
                    lambda exc: self._openai_refused(exc, kind, timings, model),
                )
            gen = generation.prepare(dp, model, timings, request.params, **asked)
        except Exception as exc:
            return self._openai_refused(exc, kind, timings, model)
        return self._openai_reply(request, kind, timings, gen)

    def _openai_refused(self, exc: Exception, kind: str, timings: Timings, model: str) -> Answer:
        error = generation.refused(self.dataplane, timings, exc, model)
        status, body, headers = openai.error_answer(error, kind)
        return status, body, with_request_id(headers, timings)

    def _openai_reply(
        self, request: openai.OpenAIRequest, kind: str, timings: Timings, gen: generation.Generation
    ) -> Reply:
        dp = self.dataplane
        prompt_text = ""
        if request.echo:  # (token ids echo as their text)
            prompt = request.prompt
            tokenizer = gen.llm.tokenizer
            prompt_text = prompt if isinstance(prompt, str) else _decoded(tokenizer, gen.prompt_ids)
        scored = request.echo and request.params.logprobs is not None
        events = generation.events(dp, gen, prompt_logprobs=scored)
        if request.stream:
            chunks = (
                responses.stream(request, events)
                if kind == openai.RESPONSES
                else openai.stream(request, events, prompt_text)
            )
            streamed = Streamed(with_request_id(openai.SSE_HEADERS, timings), chunks)
            if request.constraint is None:
                return streamed

            async def compiled() -> Answer | Streamed:  # (a bad schema: 400, not an event)
                try:
                    await openai.check_constraint(gen.llm, request)
                except Exception as exc:
                    return self._openai_refused(exc, kind, timings, request.model)
                return streamed

            return Pending(compiled)

        async def answer() -> Answer:
            try:
                doc = await (
                    responses.complete(request, events)
                    if kind == openai.RESPONSES
                    else openai.complete(request, events, prompt_text)
                )
            except Exception as exc:
                return openai.error_answer(exc, kind)
            return 200, orjson.dumps(doc), [JSON_TYPE]

        return _later(timings, answer)

    def _models(self, raw: Call) -> dict[str, Any]:
        guard = self.guard
        entries: dict[str, tuple[str, int, int]] = {}
        for mv in self.dataplane.registry.loaded_versions():
            llm = generation.engine_of(mv)
            if llm is None or not mv.ready or (guard and not guard.may_use(raw.headers, mv.name)):
                continue
            entries.setdefault(mv.name, (mv.name, self.started, llm.max_model_len))
        doc = openai.models_document(sorted(entries.values()))
        allowed = (lambda name: guard.may_use(raw.headers, name)) if guard else None
        doc["data"].extend(embeddings.model_entries(self.dataplane, self.started, allowed))
        return doc

    def _model(self, raw: Call, name: str) -> Answer:
        try:
            if self.guard is not None:
                self.guard.http_model(raw.headers, name)
            mv = self.dataplane.registry.get(name)
            llm = generation.engine_of(mv)
            doc = (
                openai.models_document([(name, self.started, llm.max_model_len)])["data"][0]
                if llm is not None
                else embeddings.model_entry(self.dataplane, mv, self.started)
            )
            if doc is None:
                raise ModelNotFound(
                    f"model: '{name}' is neither a generative nor an embedding model "
                    f"(its route: /v2/models/{name}/infer)"
                )
        except Exception as exc:
            return openai.error_answer(exc)
        return 200, orjson.dumps(doc), [JSON_TYPE]

    # ------------------------------------------------------------------ Triton generate
    def _triton(self, raw: Call, peer: str, body: bytes) -> Reply:
        dp = self.dataplane
        timings = Timings(received=raw.received_ns)
        model = ""
        try:
            if raw.method != b"POST":
                raise RouteNotFound(f"no route for {raw.method.decode()} {raw.path[:200]}")
            timings = timings_of(raw.headers, raw.received_ns)
            model, version, streamed = _generate_target(raw.path)
            self.check_body(body)
            text, params = parse_triton(body)
            asked: dict[str, Any] = {
                "prompt": text,
                "version": version,
                "request_id": timings.request_id,
                **self._client(raw, peer),
            }
            if not generation.inline(text, None):
                return _prepared_later(
                    lambda: generation.prepare_async(dp, model, timings, params, **asked),
                    lambda gen: self._triton_reply(gen, timings, streamed),
                    lambda exc: self._triton_refused(exc, timings, model),
                )
            gen = generation.prepare(dp, model, timings, params, **asked)
        except Exception as exc:
            return self._triton_refused(exc, timings, model)
        return self._triton_reply(gen, timings, streamed)

    def _triton_refused(self, exc: Exception, timings: Timings, model: str) -> Answer:
        status, body, headers = http_error(generation.refused(self.dataplane, timings, exc, model))
        return status, body, with_request_id(headers, timings)

    def _triton_reply(self, gen: generation.Generation, timings: Timings, streamed: bool) -> Reply:
        dp = self.dataplane
        head = {"model_name": gen.mv.name, "model_version": gen.mv.version}
        events = generation.events(dp, gen)
        if streamed:
            chunks = triton_stream(head, events)
            return Streamed(with_request_id(openai.SSE_HEADERS, timings), chunks)

        async def answer() -> Answer:
            try:
                text = await collect_text(events)
            except Exception as exc:
                return http_error(exc)
            return 200, orjson.dumps({**head, "text_output": text}), [JSON_TYPE]

        return _later(timings, answer)


def _prepared_later(
    prepare: Callable[[], Awaitable[generation.Generation]],
    reply: Callable[[generation.Generation], Reply],
    refuse: Callable[[Exception], Answer],
) -> Pending:
    """A long prompt's answer: ``prepare`` tokenizes it off the event loop, then ``reply``
    answers as for any other prompt (or ``refuse`` does)."""

    async def answer() -> Answer | Streamed:
        try:
            gen = await prepare()
        except Exception as exc:
            return refuse(exc)
        return await settle(reply(gen))

    return Pending(answer)


def _asked(request: openai.OpenAIRequest, timings: Timings) -> dict[str, Any]:
    """What ``generation.prepare`` takes from an OpenAI request besides its sampling."""
    return {
        "prompt": request.prompt,
        "messages": request.messages,
        "request_id": timings.request_id,
        "priority": request.priority,
    }


def _later(timings: Timings, answer: Callable[[], Awaitable[Answer]]) -> Pending:
    """``answer`` as a pending reply carrying the request's id."""

    async def run() -> Answer:
        status, body, headers = await answer()
        return status, body, with_request_id(headers, timings)

    return Pending(run)


def _decoded(tokenizer: Any, ids: list[int]) -> str:
    text: str = tokenizer.decode(ids, skip_special_tokens=True)
    return text


def parse_triton(body: bytes) -> tuple[str, SamplingParams]:
    """A generate request: ``{"text_input": str, "parameters": {...}}``; sampling
    parameters may also be top-level keys (as Triton maps JSON keys to inputs)."""
    doc = openai.json_object(body, "a JSON object with text_input")
    text = doc.get("text_input")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str) or not text:
        raise InvalidInput(f"text_input: expected a non-empty string, got {repr(text)[:60]}")
    parameters = doc.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("parameters: expected an object of sampling parameters")
    merged = {k: v for k, v in doc.items() if k not in _TRITON_KEYS}
    merged.update(parameters)
    return text, SamplingParams.from_mapping(merged).one_answer()


async def collect_text(events: AsyncGenerator[GenerationEvent, None]) -> str:
    """The whole text of a generation."""
    async with aclosing(events):
        return "".join([event.text async for event in events])


async def triton_stream(
    head: dict[str, str], events: AsyncGenerator[GenerationEvent, None]
) -> AsyncGenerator[bytes, None]:
    """generate_stream's events: one ``data: {model_name, model_version, text_output}`` per
    piece of text; a failure after the stream began is an ``{"error": ...}`` event."""
    async with aclosing(events):
        try:
            async for event in events:
                if event.text or event.finished:
                    yield openai.sse({**head, "text_output": event.text})
        except Exception as exc:
            _, body, _ = http_error(exc)
            yield b"data: " + body + b"\n\n"
