"""What one generation asks for and what it yields, shared by every API over the engine
(OpenAI, Triton generate, gRPC streaming, ``Engine.generate``).

``SamplingParams.from_mapping`` validates a request's parameters (OpenAI names); every
error is an ``InvalidInput`` naming the field and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rtserve.errors import InvalidInput

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next tokens are chosen and when a sequence ends.

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 switch those filters off;
    ``seed`` makes a sampled sequence reproducible; ``max_tokens`` None: up to the model's
    length; ``logprobs`` None: none, else the chosen token's and that many top alternatives.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], *, default_max_tokens: int | None = 16, where: str = ""
    ) -> SamplingParams:
        """The parameters named in ``data`` (others are ignored: the caller checks its own
        fields). ``where``: prefix for field names in errors (``parameters.``)."""

        def fail(key: str, expected: str) -> InvalidInput:
            value = repr(data.get(key))[:60]
            return InvalidInput(f"{where}{key}: expected {expected}, got {value}")

        def number(key: str, default: float, lo: float, hi: float) -> float:
            value = data.get(key)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise fail(key, f"a number in [{lo:g}, {hi:g}]")
            if not math.isfinite(value) or not lo <= value <= hi:
                raise fail(key, f"a number in [{lo:g}, {hi:g}]")
            return float(value)

        def integer(key: str, lo: int, hi: int) -> int | None:
            value = data.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise fail(key, f"an integer in [{lo}, {hi}]")
            return int(value)

        max_tokens = integer("max_tokens", 1, 1 << 20)
        if max_tokens is None and "max_completion_tokens" in data:
            max_tokens = integer("max_completion_tokens", 1, 1 << 20)
        elif max_tokens is None and "max_new_tokens" in data:  # Triton generate's name
            max_tokens = integer("max_new_tokens", 1, 1 << 20)
        if max_tokens is None and "max_tokens" not in data:
            max_tokens = default_max_tokens
        stop = data.get("stop")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stops = tuple(stop)
        else:
            raise fail("stop", "a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise fail(
                "stop",
                f"at most {MAX_STOP_STRINGS} non-empty strings of <= {MAX_STOP_CHARS} characters",
            )
        ignore_eos = data.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise fail("ignore_eos", "true or false")
        seed = integer("seed", -(1 << 63), (1 << 63) - 1)
        logprobs = _logprobs(data, fail)
        return cls(
            max_tokens=max_tokens,
            temperature=number("temperature", 1.0, 0.0, 2.0),
            top_p=number("top_p", 1.0, 1e-6, 1.0),
            top_k=0 if data.get("top_k") == -1 else integer("top_k", 0, 1 << 20) or 0,
            seed=seed,
            stop=stops,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
        )


# Every name ``SamplingParams.from_mapping`` reads (``Engine.generate`` refuses others).
SAMPLING_NAMES = frozenset({
    "max_tokens", "max_completion_tokens", "max_new_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "ignore_eos", "logprobs", "top_logprobs",
})  # fmt: skip


def _logprobs(data: Mapping[str, Any], fail: Any) -> int | None:
    """OpenAI chat: ``logprobs: bool`` + ``top_logprobs: int``; completions: ``logprobs: int``."""
    value = data.get("logprobs")
    if value is None or value is False:
        return None
    if value is True:
        top = data.get("top_logprobs", 0)
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
            raise fail("top_logprobs", f"an integer in [0, {MAX_LOGPROBS}]")
        return top
    if isinstance(value, int) and 0 <= value <= MAX_LOGPROBS:
        return value
    raise fail("logprobs", f"true/false or an integer in [0, {MAX_LOGPROBS}]")


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives (token text, logprob)."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class GenerationEvent:
    """One step's output for one request: the text it added (may be empty while a partial
    character or a possible stop string is held back), the token ids, and on the last event
    ``finish_reason`` (``stop`` | ``length`` | ``abort``) with the final counts."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
