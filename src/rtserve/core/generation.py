"""The lifecycle of one generation request, for every API over a generative model (OpenAI,
Triton generate, gRPC streaming, ``Engine.generate``).

``prepare`` does everything that can refuse a request before its answer starts (find the
model, encode the prompt, check its length and the first-token objective), so a refusal is
a plain error status; ``events`` then runs it through ``DataPlane.submit`` (a
``StreamRequest``: each token event reaches the sink with ``final`` False, then one final
call), keeps the token counts in the request's ``Timings``, and the dataplane records the
request once (metrics, access log, trace) however it ends: finished, failed, or closed by
its consumer (a client that went away).

A request's ``priority`` (lower runs first) is a privilege: within [PRIORITY_MIN,
PRIORITY_MAX] (else 400), and no more urgent than its key allows (``min_priority`` in the
auth file) or, for a key that sets none and without keys, its model's ``llm.min_priority``
(0 by default: a request may only lower its own urgency), else 403. Its ``tenant`` (the key's
name, or the client's address) is whose fair share of the batch and the queue it counts in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc

from rtserve.core.capabilities import GENERATE
from rtserve.core.dataplane import DataPlane, Emit, StreamRequest
from rtserve.core.model import ModelVersion
from rtserve.errors import ClientClosed, InvalidInput, Overloaded, RTServeError, as_error
from rtserve.protocol.limits import shown
from rtserve.protocol.types import InferRequest, Timings
from rtserve.runtime.llm.options import PRIORITY_MAX, PRIORITY_MIN
from rtserve.runtime.llm.params import GenerationEvent, SamplingParams

if TYPE_CHECKING:
    from rtserve.runtime.llm.engine import LlmEngine

_now = time.perf_counter_ns
log = logging.getLogger(__name__)


@dataclass(slots=True)
class Generation:
    """One generation request, checked and encoded, ready to run."""

    mv: ModelVersion
    llm: LlmEngine
    prompt_ids: list[int]
    params: SamplingParams
    timings: Timings
    request_id: str = ""
    priority: int = 0
    tenant: str = ""


class PriorityNotAllowed(RTServeError):
    """A request asks for more urgency (a lower ``priority``) than its key is granted."""

    http_status = 403
    grpc_code = grpc.StatusCode.PERMISSION_DENIED


def engine_of(mv: ModelVersion) -> LlmEngine | None:
    """The version's generation engine, or None (a tensor model)."""
    return mv.capability(GENERATE)


def generative(mv: ModelVersion) -> LlmEngine:
    """The version's generation engine; a tensor model is refused, naming the model."""
    llm = mv.capability(GENERATE)
    if llm is None:
        raise InvalidInput(
            f"model: '{mv.name}' is not a generative model (backend: llm); "
            "use /v2/models/{name}/infer"
        )
    return llm


# A prompt (or chat) of at most this many characters is tokenized on the event loop (well
# under a millisecond); a longer one on a worker thread (tokenizers release the GIL), so that
# a long prompt does not hold up every other request's answer for tens of milliseconds.
def _inline_chars() -> int:
    text = os.environ.get("RTSERVE_INLINE_PROMPT_CHARS", "8192")
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        log.warning("RTSERVE_INLINE_PROMPT_CHARS: expected an integer >= 0, got %r; 8192", text)
        return 8192
    return value


INLINE_CHARS = _inline_chars()
# Long prompts are read by these threads (not the loop's default executor, which loads
# models and inflates bodies); at most MAX_READING wait or run, others are refused (503).
_READERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rtserve-tokenize")
MAX_READING = 64
_reading = 0


def prepare(
    dataplane: DataPlane,
    model: str,
    timings: Timings,
    params: SamplingParams,
    *,
    prompt: str | list[int] | None = None,
    messages: Any = None,
    version: str = "",
    request_id: str = "",
    priority: int = 0,
    tenant: str = "",
    min_priority: int | None = None,
) -> Generation:
    """Resolve, encode and check a request (``prompt``: text or token ids; ``messages``: a
    chat); raises the ``RTServeError`` it is refused with (the caller records it with
    ``refused``). Tokenizes on the calling thread: :func:`prepare_async` for long text.
    ``tenant``: whose share it counts in; ``min_priority``: the most urgent priority the
    request's key is granted (None: the model's ``llm.min_priority``)."""
    mv, llm = _target(dataplane, model, version, timings, priority, min_priority)
    ids = _encode(llm, prompt, messages)
    gen = _checked(
        mv, llm, ids, params, timings, request_id, priority, messages is not None, tenant
    )
    return gen


async def prepare_async(
    dataplane: DataPlane,
    model: str,
    timings: Timings,
    params: SamplingParams,
    *,
    prompt: str | list[int] | None = None,
    messages: Any = None,
    version: str = "",
    request_id: str = "",
    priority: int = 0,
    tenant: str = "",
    min_priority: int | None = None,
) -> Generation:
    """:func:`prepare`, with text longer than ``INLINE_CHARS`` tokenized on a worker thread."""
    if inline(prompt, messages):
        return prepare(
            dataplane, model, timings, params, prompt=prompt, messages=messages,
            version=version, request_id=request_id, priority=priority, tenant=tenant,
            min_priority=min_priority,
        )  # fmt: skip
    global _reading
    mv, llm = _target(dataplane, model, version, timings, priority, min_priority)
    if _reading >= MAX_READING:
        raise Overloaded(
            f"{MAX_READING} long prompts are being read; retry later (or send shorter ones)"
        )
    _reading += 1
    try:
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(_READERS, _encode, llm, prompt, messages)
    except asyncio.CancelledError:  # the client went away while its prompt was read
        refused(dataplane, timings, ClientClosed("the client went away"), model, mv)
        raise
    finally:
        _reading -= 1
    gen = _checked(
        mv, llm, ids, params, timings, request_id, priority, messages is not None, tenant
    )
    return gen


def inline(prompt: Any, messages: Any) -> bool:
    """Whether the request's text is short enough to tokenize on the event loop."""
    if isinstance(prompt, str):
        return len(prompt) <= INLINE_CHARS
    if not isinstance(messages, list):
        return True  # (token ids, or malformed: prepare refuses it at once)
    chars = 0
    for m in messages:  # (each part counts at least one character: many parts cost too)
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                chars += max(1, len(text)) if isinstance(text, str) else 1
                if chars > INLINE_CHARS:
                    return False
        if chars > INLINE_CHARS:
            return False
    return True


def _target(
    dataplane: DataPlane,
    model: str,
    version: str,
    timings: Timings,
    priority: Any,
    min_priority: int | None,
) -> tuple[ModelVersion, LlmEngine]:
    """The generative model version a request names (its priority checked first: its range,
    then against the floor its key or its model allows)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidInput(f"priority: expected an integer, got {shown(repr(priority))}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidInput(
            f"priority: expected an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] "
            f"(lower runs first), got {shown(repr(priority))}"
        )
    mv = dataplane.resolve(model, version, timings)
    llm = generative(mv)
    floor = llm.options.min_priority if min_priority is None else min_priority
    if priority < floor:
        granted = "this key is granted" if min_priority is not None else "the model allows"
        raise PriorityNotAllowed(
            f"priority: {priority} asks for more urgency than {granted}: expected at least "
            f"{floor} (lower runs first)"
        )
    return mv, llm


def _encode(llm: LlmEngine, prompt: Any, messages: Any) -> list[int]:
    if messages is not None:
        return llm.encode_messages(messages)
    if isinstance(prompt, str):
        return llm.encode_text(prompt)
    if isinstance(prompt, list) and prompt:
        llm.check_length(len(prompt))  # a long list is refused before it is read
        return _token_ids(prompt, len(llm.tokenizer))
    raise InvalidInput("prompt: expected a string or a non-empty list of token ids")


def _checked(
    mv: ModelVersion,
    llm: LlmEngine,
    ids: list[int],
    params: SamplingParams,
    timings: Timings,
    request_id: str,
    priority: int,
    chat: bool,
    tenant: str = "",
) -> Generation:
    # What the request left unset: the model's sampling (generation_config.json) and an
    # answer of at most llm.default_max_tokens, within what the context leaves.
    params = llm.sampling_defaults.apply(
        params, len(ids), llm.max_model_len, llm.options.default_max_tokens
    )
    llm.check_prompt(len(ids), params, "messages" if chat else "prompt", tenant)
    timings.prompt_tokens = len(ids)
    return Generation(mv, llm, ids, params, timings, request_id, priority, tenant)


def _token_ids(ids: list[Any], vocab: int) -> list[int]:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise InvalidInput(f"prompt[{i}]: expected a token id in [0, {vocab}), got {t!r:.40}")
    return ids


def refused(
    dataplane: DataPlane,
    timings: Timings,
    error: BaseException,
    model: str = "",
    mv: ModelVersion | None = None,
) -> RTServeError:
    """Record a request refused before its generation started; returns its error. It is
    counted under ``model`` when that model is loaded (a bad request to a served model is
    that model's client error, not an unrouted request)."""
    err = as_error(error, "generation request")
    if mv is None and model:
        with contextlib.suppress(RTServeError):
            mv = dataplane.registry.get_loaded(model)
    request = InferRequest(mv.name if mv else model[:100], mv.version if mv else "", [])
    request.timings = timings
    dataplane.observe(request, mv, err, _now())
    return err


class _Channel:
    """Where a generation's outputs wait for ``events`` to take them: the producer waits
    while the reader is behind, so a reader that does not read pauses the sequence (the
    engine pauses it when its events are not taken)."""

    __slots__ = ("items", "exc", "task", "_wake", "_taken")

    def __init__(self) -> None:
        self.items: deque[tuple[Any, RTServeError | None, bool]] = deque()
        self.exc: BaseException | None = None  # the producer's own exception, re-raised
        self.task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None  # the reader waits
        self._taken: asyncio.Future[None] | None = None  # the producer waits

    def sink(
        self, _: InferRequest, __: ModelVersion | None, output: Any, error: Any, final: bool
    ) -> None:
        """The dataplane's sink: many outputs, then one final call."""
        self.items.append((output, error, final))
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def take(self) -> tuple[Any, RTServeError | None, bool]:
        while not self.items:
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        item = self.items.popleft()
        taken = self._taken
        if taken is not None and not taken.done():
            taken.set_result(None)
        return item

    async def taken(self) -> None:
        """Until the reader is at most one output behind (a reader that keeps up costs the
        producer no wait)."""
        while len(self.items) > 1:
            self._taken = asyncio.get_running_loop().create_future()
            await self._taken


_PRODUCERS: set[asyncio.Task[None]] = set()  # (a task needs a strong reference)


def _start(gen: Generation, prompt_logprobs: bool, channel: _Channel, emit: Emit) -> Any:
    """``StreamRequest.start``: run the generation on its own task."""
    task = asyncio.get_running_loop().create_task(_produce(gen, prompt_logprobs, channel, emit))
    channel.task = task
    _PRODUCERS.add(task)
    task.add_done_callback(_PRODUCERS.discard)
    return task.cancel


async def _produce(gen: Generation, prompt_logprobs: bool, channel: _Channel, emit: Emit) -> None:
    """The engine's events to the dataplane, one taken at a time; then the final call (its
    error: None when finished, ``ClientClosed`` when the reader went away)."""
    timings = gen.timings
    error: RTServeError | None = ClientClosed("the client went away before the answer ended")
    stream = gen.llm.generate(
        gen.prompt_ids,
        gen.params,
        request_id=gen.request_id,
        priority=gen.priority,
        tenant=gen.tenant,
        checked=True,  # (by prepare)
        prompt_logprobs=prompt_logprobs,
    )
    try:
        async for event in stream:
            timings.completion_tokens = event.completion_tokens
            if event.prompt_tokens:
                timings.prompt_tokens = event.prompt_tokens
            if event.finished:
                error = None
                timings.done = _now()
            emit(event, None, False)
            await channel.taken()
    except asyncio.CancelledError:
        pass  # the reader went away: the sequence is aborted below
    except Exception as exc:
        channel.exc = exc
        error = as_error(exc, "generation request")
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # an async generator
        emit(None, error, True)


async def events(
    dataplane: DataPlane, gen: Generation, *, prompt_logprobs: bool = False
) -> AsyncGenerator[GenerationEvent, None]:
    """The generation's events, through ``DataPlane.submit`` (a ``StreamRequest`` whose
    outputs are the events). Closing this iterator early (``aclose``, or cancelling the
    task that awaits it) aborts the sequence; the request is recorded once at the end.
    ``prompt_logprobs``: the first event carries the prompt's (``LlmEngine.generate``)."""
    mv = gen.mv
    gen.timings.enqueued = _now()
    channel = _Channel()
    request = StreamRequest(mv.name, mv.version, [], id=gen.request_id, timings=gen.timings)
    request.start = partial(_start, gen, prompt_logprobs, channel)
    cancel = dataplane.submit(mv.name, mv.version, gen.timings, lambda _: request, channel.sink)
    try:
        while True:
            output, error, final = await channel.take()
            if final:
                if error is not None:
                    raise channel.exc or error
                return
            yield output
    finally:
        task = channel.task
        if task is not None and not task.done():
            if cancel is not None:
                cancel()
            await asyncio.wait([task])  # (the sequence aborted and the request recorded)
