"""Constrained decoding: a token mask per row from llguidance's grammar engine.

A :class:`~rtserve.runtime.llm.params.Constraint` (JSON object, JSON schema, regex, choice list) is
compiled once into a matcher and kept in a bounded LRU cache; each sequence decodes with its
own copy of that matcher, which gives the tokens allowed next (a bit per vocabulary entry,
about 0.03 ms per step on SmolLM2's 49,152) and takes each chosen token. End of sequence is
allowed only where the grammar may end; once it can take nothing more the sequence finishes
("stop"). JSON grammars are compact: no whitespace between tokens outside strings, and a
number's digits are bounded where its schema leaves them open (``bounded_numbers``).

Compiling runs in one worker thread with a timeout (``compile_timeout_s``): a slow schema is
refused without stalling the event loop or the step loop. The parser's own limits bound
each mask (lexer fuel, Earley items), and schemas are bounded in size before they compile.
llguidance was chosen over xgrammar and outlines-core: it installs alone (xgrammar pulls
triton), compiles lazily in milliseconds (outlines-core builds its whole index first,
~270 ms for a small schema) and has per-step limits; its mask per step is within 0.1 ms.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from rtserve.errors import InvalidInput
from rtserve.runtime.llm.params import CONSTRAINT_KINDS, Constraint

CACHE_SIZE = 64  # compiled constraints kept
MAX_SPEC_CHARS = 64 << 10  # a schema's (regex's, choices') JSON text
MAX_CHOICES = 1024
COMPILE_TIMEOUT_S = 10.0
FIELD = "response_format"  # what the API calls a constraint (errors name it)


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _limits() -> Any:
    import llguidance

    return llguidance.LLParserLimits(
        max_grammar_size=200_000,
        max_lexer_states=50_000,  # (~1-2 kB each: <= ~100 MB per grammar)
        step_lexer_fuel=200_000,  # (~15 ms at most per mask)
        step_max_items=50_000,
        initial_lexer_fuel=1_000_000,
        verbose_errors=False,
    )


# A number's digits where its schema leaves them open: without a bound a model (a random-weight
# one, a small one in a loop) can write digits until max_tokens and the JSON never parses.
MAX_INTEGER = 2**53 - 1  # (the integers every JSON parser reads exactly)
DECIMALS = 6  # a number without multipleOf: at most this many decimals, no exponent
_LITERALS = ("enum", "const", "default", "examples")  # (values, not schemas)


def bounded_numbers(schema: Any) -> Any:
    """``schema`` with each integer's and number's open bounds closed at +-``MAX_INTEGER``
    and a number without ``multipleOf`` held to ``DECIMALS`` decimals (unless a bound of
    its own is finer); what it decodes still matches ``schema``. A copy, made without
    recursion (a schema may nest deeper than Python's stack)."""
    top: dict[str, Any] = {}
    stack: list[tuple[Any, Any]] = [({"schema": schema}, top)]
    while stack:
        source, copy = stack.pop()
        items = source.items() if isinstance(source, dict) else enumerate(source)
        for key, value in items:
            literal = isinstance(source, dict) and key in _LITERALS
            if isinstance(value, dict | list) and not literal:
                copy[key] = {} if isinstance(value, dict) else [None] * len(value)
                stack.append((value, copy[key]))
            else:
                copy[key] = value
        if isinstance(source, dict):
            _close_numbers(source, copy)
    return top["schema"]


def _close_numbers(source: dict[str, Any], copy: dict[str, Any]) -> None:
    kinds = source.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if not {"integer", "number"} & {k for k in kinds if isinstance(k, str)}:
        return

    def number(key: str) -> bool:
        value = source.get(key)
        return isinstance(value, int | float) and not isinstance(value, bool)

    if not number("minimum") and not number("exclusiveMinimum"):
        copy["minimum"] = -MAX_INTEGER
    if not number("maximum") and not number("exclusiveMaximum"):
        copy["maximum"] = MAX_INTEGER

    def coarse(key: str) -> bool:  # (a multiple of 10**-DECIMALS, or no bound)
        if not number(key) or isinstance(source[key], int):
            return True
        scaled = source[key] * 10**DECIMALS
        return not math.isfinite(scaled) or abs(scaled - round(scaled)) < 1e-6

    bounds = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    if "number" in kinds and "multipleOf" not in source and all(map(coarse, bounds)):
        copy["multipleOf"] = 10.0**-DECIMALS


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``; InvalidInput naming the field if it is not
    one."""
    import llguidance

    kind, spec = constraint.kind, constraint.spec
    if kind not in CONSTRAINT_KINDS:
        raise InvalidInput(
            f"{FIELD}: expected a type in {', '.join(CONSTRAINT_KINDS)}, got {kind!r}"
        )
    if len(constraint.key) > MAX_SPEC_CHARS:
        raise InvalidInput(f"{FIELD}: the {kind} is over {MAX_SPEC_CHARS} characters of JSON")
    options: Any = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    if kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, options))
    if kind == "json_schema":
        if not isinstance(spec, dict):
            raise InvalidInput(
                f"{FIELD}: expected a JSON schema (an object), got {type(spec).__name__}"
            )
        try:
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(bounded_numbers(spec), options)
            )
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"{FIELD}: the JSON schema cannot be used: {exc}"[:300]) from exc
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidInput(f"{FIELD}: expected a regular expression (a non-empty string)")
        return str(llguidance.LLMatcher.grammar_from_regex(spec))
    if (
        not isinstance(spec, list)
        or not spec
        or len(spec) > MAX_CHOICES
        or not all(isinstance(c, str) and c for c in spec)
    ):
        raise InvalidInput(
            f"{FIELD}: expected a choice list of 1 to {MAX_CHOICES} non-empty strings"
        )
    body = " | ".join(json.dumps(c) for c in dict.fromkeys(spec))
    return str(llguidance.LLMatcher.grammar_from_lark(f"start: {body}"))


class GrammarState:
    """One sequence's place in its grammar (a matcher of its own)."""

    __slots__ = ("matcher", "_bits")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self._bits = np.empty(0, dtype=np.uint8)

    def allowed(self, vocab: int) -> torch.Tensor | None:
        m = self.matcher
        if m.is_error() or m.is_stopped():
            return None  # (the engine ends it)
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if bits.shape[0] >= vocab:  # (0 / 1 bytes read as bools: no copy, no torch fill)
            return torch.from_numpy(bits[:vocab].view(np.bool_))
        out = torch.zeros(vocab, dtype=torch.bool)
        out[: bits.shape[0]] = torch.from_numpy(bits.view(np.bool_))
        return out

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """It can take no more tokens (complete, or failed)."""
        return bool(self.matcher.is_stopped() or self.matcher.is_error())

    @property
    def error(self) -> str | None:
        """Why the grammar failed while generating (e.g. a schema with no finite instance
        reaching the parser's limits), or None."""
        m = self.matcher
        return str(m.get_error())[:300] if m.is_error() else None

    def fork(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy())


class Grammars:
    """The compiled constraints of one model: its token table (built once, ~1 s) and an LRU
    cache of matchers in their start state, each copied for a sequence."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: list[int],
        *,
        cache_size: int = CACHE_SIZE,
        timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._table: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.compiles = 0  # (cache misses, for tests and metrics)

    def _tokens(self) -> Any:
        import llguidance.hf

        with self._lock:
            if self._table is None:
                self._table = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids or None
                )
            return self._table

    def _compile(self, constraint: Constraint) -> Any:
        """The matcher in its start state (cached), its first mask computed (the lexer's
        first states are built here, not in the step loop)."""
        import llguidance

        key = constraint.key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        text = grammar_text(constraint)
        matcher = llguidance.LLMatcher(self._tokens(), text, log_level=0, limits=_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            error = matcher.get_error()
            raise InvalidInput(f"{FIELD}: the {constraint.kind} cannot be used: {error}"[:400])
        with self._lock:
            self.compiles += 1
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    async def check(self, constraint: Constraint) -> None:
        """Compile ``constraint`` off the event loop (cached); InvalidInput naming the field
        if it cannot be used or takes over ``timeout_s``."""
        if not available():
            raise InvalidInput(
                f"{FIELD}: structured output needs the llguidance package (the llm extra)"
            )
        with self._lock:
            if constraint.key in self._cache:
                return
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._compile, constraint)
        try:
            await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise InvalidInput(
                f"{FIELD}: the {constraint.kind} took over {self.timeout_s:g} s to compile; "
                "expected a simpler one"
            ) from None

    def state(self, constraint: Constraint) -> GrammarState:
        """A new sequence's grammar state (compiled by ``check`` first, else now)."""
        return GrammarState(self._compile(constraint).deep_copy())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
