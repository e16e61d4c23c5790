"""What one generation asks for and what it yields, shared by every API over the engine
(OpenAI, Triton generate, gRPC streaming, ``Engine.generate``).

``SamplingParams.from_mapping`` validates a request's parameters (OpenAI names); every
error is an ``InvalidInput`` naming the field and what was expected.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rtserve.errors import InvalidInput

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
# Below this a temperature is greedy: dividing logits by it overflows float32.
MIN_TEMPERATURE = 1e-5
MAX_N = 16  # choices of one request
MAX_LOGIT_BIAS = 300  # entries (OpenAI's bound)
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice")
# Fields other servers take that would change the answer and rtserve does not honour, with
# the value that means "not used": any other value is refused, never silently ignored.
NOT_HONOURED: dict[str, Any] = {
    "bad_words": None, "allowed_token_ids": None,
    "guided_choice": None, "guided_json": None, "guided_regex": None, "guided_grammar": None,
    "use_beam_search": False, "length_penalty": 1, "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
}  # fmt: skip


def not_neutral(data: Mapping[str, Any], neutral: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field of ``neutral`` that ``data`` sets to a value other than the one that
    means "not used" (absent, null, [] and {} are not used too), with what was expected;
    None if there is none."""
    for key, unused in neutral.items():
        value = data.get(key)
        if value is not None and value != unused and value != [] and value != {}:
            return key, "absent" if unused is None else f"{json.dumps(unused)} or absent"
    return None


@dataclass(frozen=True, slots=True, eq=False)
class Constraint:
    """What the output must match: ``kind`` json_object (any JSON object; ``spec`` unused),
    json_schema (``spec`` the schema, a dict), regex (``spec`` a pattern) or choice (``spec``
    a list of strings). Compiled by ``llm/grammar.py``; equal constraints share one compile."""

    kind: str
    spec: Any = None

    @property
    def key(self) -> str:
        """The constraint as canonical JSON (the compile cache's key)."""
        return json.dumps([self.kind, self.spec], sort_keys=True, separators=(",", ":"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Constraint) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next tokens are chosen and when a sequence ends.

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 switch those filters off;
    ``seed`` makes a sampled sequence reproducible (choice ``i`` of ``n`` uses ``seed + i``);
    ``max_tokens`` None: up to the model's
    length (a request through the APIs that sets none gets the model's default length
    instead, ``llm/defaults.py``); ``logprobs`` None: none, else the chosen token's and that many top alternatives.

    Logit changes (``llm/sampler.py``, only for the rows that ask): ``repetition_penalty``
    divides the positive logits (multiplies the negative) of every token in the prompt or
    the answer so far; ``frequency_penalty`` subtracts itself times each token's count in
    the answer, ``presence_penalty`` once per token present; ``logit_bias`` adds to the
    named token ids; ``min_tokens``: no end of sequence (EOS, ``stop_token_ids``) before
    that many tokens; ``min_p``: sampling keeps the tokens at least ``min_p`` times as
    likely as the most likely; ``constraint``: a grammar's token mask.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Of temperature, top_p, top_k: those the request left unset, which the model's own
    # defaults (its generation_config.json, ``llm/defaults.py``) fill in; () when built
    # directly (the values above are then what was meant).
    unset: frozenset[str] = frozenset()
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """It counts the tokens it has seen (a penalty is set)."""
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )

    @property
    def changes_logits(self) -> bool:
        """Its logits are changed before the choice (the sampler's slow path for its row;
        the runner computes every logit of its row exactly)."""
        return bool(self.penalized or self.logit_bias or self.min_tokens or self.constraint)

    def one_answer(self, field: str = "n") -> SamplingParams:
        """These parameters, when they ask one answer: Triton's generate routes send one
        text, which ``n`` answers would interleave into (InvalidInput naming ``field``)."""
        if self.n != 1:
            raise InvalidInput(
                f"{field}: expected 1 or absent (generate answers one text), got {self.n}"
            )
        return self

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

        used = not_neutral(data, NOT_HONOURED)
        if used is not None:
            raise fail(used[0], f"{used[1]} (not supported by rtserve)")
        # (OpenAI's newer name first, as vLLM; null is as absent: the route's default)
        max_tokens = integer("max_completion_tokens", 1, 1 << 20)
        if max_tokens is None:
            max_tokens = integer("max_tokens", 1, 1 << 20)
        if max_tokens is None:  # Triton generate's name
            max_tokens = integer("max_new_tokens", 1, 1 << 20)
        if max_tokens is None:
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
        ids = data.get("stop_token_ids")
        if ids is not None and (
            not isinstance(ids, list)
            or len(ids) > MAX_STOP_TOKEN_IDS
            or any(type(t) is not int or not 0 <= t < 1 << 31 for t in ids)
        ):
            raise fail(
                "stop_token_ids",
                f"a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0 within the "
                "model's vocabulary)",
            )
        n = integer("n", 1, MAX_N)
        return cls(
            max_tokens=max_tokens,
            temperature=number("temperature", 1.0, 0.0, 2.0),
            top_p=number("top_p", 1.0, 1e-6, 1.0),
            top_k=0 if data.get("top_k") == -1 else integer("top_k", 0, 1 << 20) or 0,
            seed=seed,
            stop=stops,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            stop_token_ids=tuple(ids or ()),
            unset=frozenset(k for k in MODEL_DEFAULTED if data.get(k) is None),
            n=1 if n is None else n,
            frequency_penalty=number("frequency_penalty", 0.0, -2.0, 2.0),
            presence_penalty=number("presence_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=_repetition(data, fail),
            logit_bias=_logit_bias(data, fail),
            min_p=number("min_p", 0.0, 0.0, 1.0),
            min_tokens=integer("min_tokens", 0, 1 << 20) or 0,
        )


# The sampling fields a model's generation_config.json may set for requests that do not.
MODEL_DEFAULTED = ("temperature", "top_p", "top_k")

# Every name ``SamplingParams.from_mapping`` reads (``Engine.generate`` refuses others).
SAMPLING_NAMES = frozenset({
    "max_tokens", "max_completion_tokens", "max_new_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "ignore_eos", "logprobs", "top_logprobs", "stop_token_ids", "n",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_p",
    "min_tokens",
})  # fmt: skip


def _repetition(data: Mapping[str, Any], fail: Any) -> float:
    value = data.get("repetition_penalty")
    if value is None:
        return 1.0
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0.0 < value <= 2.0
    ):
        raise fail("repetition_penalty", "a number in (0, 2]")
    return float(value)


def _logit_bias(data: Mapping[str, Any], fail: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (ids as strings or integers, bias in [-100, 100])."""
    value = data.get("logit_bias")
    if value is None:
        return ()
    expected = (
        f"an object of at most {MAX_LOGIT_BIAS} token ids (as strings) to numbers in [-100, 100]"
    )
    if not isinstance(value, Mapping) or len(value) > MAX_LOGIT_BIAS:
        raise fail("logit_bias", expected)
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise fail("logit_bias", expected) from None
        if (
            isinstance(key, bool)
            or not 0 <= token < 1 << 31
            or isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not math.isfinite(bias)
            or not -100 <= bias <= 100
        ):
            raise fail("logit_bias", expected)
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _logprobs(data: Mapping[str, Any], fail: Any) -> int | None:
    """OpenAI chat: ``logprobs: bool`` + ``top_logprobs: int``; completions: ``logprobs: int``."""
    value = data.get("logprobs")
    if value is None or value is False:
        if data.get("top_logprobs") not in (None, 0):
            raise fail("top_logprobs", "absent unless logprobs is true")
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
    """The chosen token's log-probability (None: a prompt's first token, which nothing
    predicts) and the top alternatives (token text, logprob). ``token`` is the token's bytes
    decoded leniently (part of a character reads U+FFFD); ``raw`` and ``top_raw`` are the
    bytes (None: the text's UTF-8); ``offset``: where the token's text starts in the text of
    its generation (or of its prompt), in characters."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] = field(default_factory=list)
    raw: bytes | None = None
    top_raw: list[bytes] | None = None
    offset: int = 0


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
    # Each prompt token's logprob, on the first event of a request that asked for them.
    prompt_logprobs: list[TokenLogprob] | None = None
    index: int = 0  # which of the request's ``n`` choices

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
