"""One generative model version: the step loop in its own thread, and ``generate``.

The loop runs while there is work: take new requests and aborts, schedule a step (decodes
first, then prompt chunks, within the token budget and the token objective's limit), run
it, sample, and hand each request its new text through the event loop it came from (one
``call_soon_threadsafe`` per loop per step). A consumer that stops iterating (a client
that disconnected) aborts its sequence before the next step; one that leaves its events
untaken for ``unread_timeout_s`` (a client that does not read its stream) has its sequence
paused out of the batch until it takes them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from rtserve.errors import InferenceFailed, InvalidInput, ObjectiveRefused, Overloaded, ShuttingDown
from rtserve.runtime.llm import chat
from rtserve.runtime.llm.defaults import SamplingDefaults
from rtserve.runtime.llm.detok import Detokenizer, text_offsets
from rtserve.runtime.llm.grammar import FIELD as GRAMMAR_FIELD
from rtserve.runtime.llm.grammar import Grammars
from rtserve.runtime.llm.kv import BlockPool
from rtserve.runtime.llm.metrics import LlmMetrics, token_objectives
from rtserve.runtime.llm.options import LlmOptions
from rtserve.runtime.llm.params import GenerationEvent, SamplingParams, TokenLogprob
from rtserve.runtime.llm.runner import ModelRunner, release_openmp
from rtserve.runtime.llm.sampler import (
    RowLogits,
    logprobs_of,
    new_generator,
    prompt_logprobs,
    sample,
)
from rtserve.runtime.llm.scheduler import FINISHED, PAUSED, Scheduler, Sequence, Step
from rtserve.runtime.llm.speculative import Speculator, probabilities, verify_greedy, verify_sampled
from rtserve.runtime.llm.tokens import TokenBytes

log = logging.getLogger(__name__)
_now = time.perf_counter_ns


class TenantQueueFull(Overloaded):
    """One tenant's requests fill its part of the queue: its excess is refused (HTTP 429
    with Retry-After, gRPC RESOURCE_EXHAUSTED); other tenants' requests are not."""

    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StepModel:
    """Step time ~ a + b * decodes + c * prompt tokens, fitted by least squares over
    recent steps; it sizes prompt chunks for the inter-token objective and predicts the
    first token's wait for the first-token objective. ``tail`` is the 95th percentile of
    measured / fitted time over those steps: how much slower than the fit a slow step is
    (other work on the cores, page faults), which a p99 objective has to allow for."""

    TAIL_QUANTILE = 0.95

    def __init__(self, size: int = 256) -> None:
        self._rows: list[tuple[float, float, float]] = []
        self._size = size
        self.coef = (0.005, 0.0005, 0.0002)
        self.tail = 1.0

    def add(self, decodes: int, prefill: int, seconds: float) -> None:
        self._rows.append((decodes, prefill, seconds))
        if len(self._rows) > self._size:
            del self._rows[: len(self._rows) - self._size]
        if len(self._rows) >= 8 and len(self._rows) % 8 == 0:
            self._fit()

    def clear(self) -> None:
        """Forget the measured steps (the fit and tail stay until new ones replace them)."""
        self._rows.clear()

    def _fit(self) -> None:
        data = np.array(self._rows, dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        coef, *_ = np.linalg.lstsq(x, data[:, 2], rcond=None)
        a, b, c = (max(float(v), 1e-7) for v in coef)
        self.coef = (a, b, c)
        fitted = x @ np.array(self.coef)
        ratio = data[:, 2] / np.maximum(fitted, 1e-6)
        self.tail = max(1.0, float(np.quantile(ratio, self.TAIL_QUANTILE)))

    def time(self, decodes: int, prefill: int) -> float:
        a, b, c = self.coef
        return a + b * decodes + c * prefill

    def prefill_for(self, decodes: int, seconds: float) -> int:
        a, b, c = self.coef
        return int((seconds - a - b * decodes) / c)


class LlmEngine:
    def __init__(self, name: str, version: str, version_dir: Path, options: LlmOptions) -> None:
        self.name = name
        self.version = version
        self.options = options
        self.runner = ModelRunner(version_dir, options)
        # What a request leaves unset: the model's generation_config.json, the length capped.
        self.sampling_defaults = SamplingDefaults.load(version_dir)
        self.tokenizer = self.runner.tokenizer
        self.token_bytes = TokenBytes(self.tokenizer)  # (logprobs' token text and bytes)
        self.max_model_len = self.runner.max_model_len
        # Structured output's compiled grammars (``llm/grammar.py``; built on first use).
        self.grammars = Grammars(
            self.tokenizer, self.runner.vocab_size, sorted(self.runner.eos_ids)
        )
        self.pool = BlockPool(self.runner.num_blocks, options.block_size, options.prefix_caching)
        # No prompt that fits max_model_len tokens is longer than this many characters (no
        # token's text is longer than its vocabulary entry): longer text is refused before
        # the tokenizer spends time and memory on it.
        self.max_prompt_chars = self.max_model_len * longest_token(self.tokenizer) + 4096
        self.scheduler = Scheduler(
            self.pool,
            options.max_num_seqs,
            options.max_num_batched_tokens,
            fair_share=options.fair_share,
            weights=dict(options.tenant_weights),
        )
        self.speculator: Speculator | None = None
        if options.speculative is not None:
            self.speculator = Speculator(
                options.speculative, version_dir, self.tokenizer, self.runner.vocab_size,
                self.runner.device, self.runner.dtype,
            )  # fmt: skip
        self.metrics = LlmMetrics(name, version, objectives=token_objectives(options.slo))
        self.metrics.gauges = self._gauges
        self.metrics.prefix = lambda: (self.pool.queries, self.pool.hits)
        self.metrics.counts = self._counts
        self.stalled = 0  # streams paused because their consumer did not take their events
        self._next_stall_check = 0
        self.step_model = StepModel()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._incoming: list[Sequence] = []
        self._aborts: list[Sequence] = []
        self._resumes: list[Sequence] = []
        self._stopping = False
        self._failed: BaseException | None = None
        self.on_failed: Callable[[], None] | None = None  # the step loop ended by an error
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self._step_started = 0.0  # (perf_counter; 0: no step in progress)
        self._step_expected = 0.0

    # ---------------------------------------------------------------- requests
    def check_chars(self, chars: int, field: str = "prompt") -> None:
        """Refuse text too long for ``max_model_len`` tokens before it is tokenized."""
        if chars > self.max_prompt_chars:
            raise InvalidInput(
                f"{field}: {chars} characters, expected at most {self.max_prompt_chars} "
                f"(more cannot fit max_model_len, {self.max_model_len} tokens)"
            )

    def _encode(self, text: str, special: bool, field: str) -> list[int]:
        """Token ids of ``text``; text that cannot fit ``max_model_len`` is refused first on its
        length in characters, then on the tokens of a prefix (a few milliseconds) instead of
        the whole (the tokenizer runs on the event loop)."""
        self.check_chars(len(text), field)
        window = self.max_model_len * PREFIX_CHARS_PER_TOKEN
        if len(text) > window:
            head = len(self.tokenizer.encode(text[:window], add_special_tokens=False))
            if head >= self.max_model_len + PREFIX_SLACK_TOKENS:  # (a cut word: a few more)
                raise InvalidInput(
                    f"{field}: {head} tokens in its first {window} characters alone, expected "
                    f"fewer than max_model_len ({self.max_model_len}) in all"
                )
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=special)
        return ids

    def encode_text(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidInput(f"prompt: expected a string, got {type(text).__name__}")
        ids = self._encode(text, True, "prompt")
        if not ids:
            raise InvalidInput("prompt: expected at least one token, got an empty prompt")
        return ids

    def encode_messages(self, messages: Any) -> list[int]:
        """The chat template applied to OpenAI-style messages, tools included
        (``chat.encode_messages``; checked first)."""
        return chat.encode_messages(self, messages)

    def check_length(self, n_prompt: int, field: str = "prompt") -> None:
        """Refuse a prompt of ``max_model_len`` tokens or more."""
        if n_prompt >= self.max_model_len:
            raise InvalidInput(
                f"{field}: {n_prompt} tokens, expected fewer than max_model_len "
                f"({self.max_model_len}) to leave room for an answer"
            )

    def check_prompt(
        self, n_prompt: int, params: SamplingParams, field: str = "prompt", tenant: str = ""
    ) -> None:
        """Refuse what can never run (too long), would miss the first-token objective, or
        finds the queue full (all of it, or ``tenant``'s part of it)."""
        self.check_length(n_prompt, field)
        limit = self.max_model_len
        if params.max_tokens is not None and n_prompt + params.max_tokens > limit:
            raise InvalidInput(
                f"max_tokens: {params.max_tokens} with a {n_prompt}-token prompt exceeds "
                f"max_model_len ({limit}); expected at most {limit - n_prompt}"
            )
        total = n_prompt + (params.max_tokens or limit - n_prompt)
        if self.pool.blocks_for(total) > self.pool.num_blocks:
            raise InvalidInput(
                f"max_tokens: prompt + answer ({total} tokens) exceeds the KV pool "
                f"({self.pool.num_blocks * self.pool.block_size} tokens); ask for fewer tokens"
            )
        if params.n > 1:  # (the choices share the prompt's blocks; each answer has its own)
            answer = self.pool.blocks_for(total - n_prompt + self.pool.block_size)
            if self.pool.blocks_for(total) + (params.n - 1) * answer > self.pool.num_blocks:
                raise InvalidInput(
                    f"n: {params.n} answers of up to {total - n_prompt} tokens exceed the KV "
                    "pool; ask for fewer choices or fewer tokens"
                )
        self.check_vocabulary(params)
        sched = self.scheduler
        if len(sched.waiting) >= self.options.max_waiting:
            self.metrics.refused += 1
            raise Overloaded(f"model {self.name}: {len(sched.waiting)} requests waiting", 1.0)
        self._check_tenant_queue(tenant)
        slo = self.options.slo
        if slo is not None and slo.ttft_p99_ms > 0:
            wait = self.first_token_wait(n_prompt)
            if wait * 1000 > slo.ttft_p99_ms:
                self.metrics.refused += 1
                raise ObjectiveRefused(
                    f"model {self.name}: the first token would come in ~{wait * 1000:.0f} ms, "
                    f"over the objective ttft_p99_ms={slo.ttft_p99_ms:g}",
                    retry_after_s=max(1.0, wait - slo.ttft_p99_ms / 1000),
                )

    def check_vocabulary(self, params: SamplingParams) -> None:
        """InvalidInput naming ``logit_bias`` or ``stop_token_ids`` when a token id there is
        not one of the model's (the request's parser cannot know the model)."""
        vocab = self.runner.vocab_size
        for field, tokens in (
            ("logit_bias", (token for token, _ in params.logit_bias)),
            ("stop_token_ids", params.stop_token_ids),
        ):
            for token in tokens:
                if token >= vocab:
                    raise InvalidInput(
                        f"{field}: token id {token} is not in the vocabulary, expected ids "
                        f"in [0, {vocab})"
                    )

    async def check_constraint(self, params: SamplingParams) -> None:
        """Compile the request's constraint (structured output) off the event loop, cached;
        InvalidInput naming ``response_format`` when it cannot be used or is too slow to
        compile. ``generate`` calls it too (cached: free the second time)."""
        if params.constraint is not None:
            await self.grammars.check(params.constraint)

    def _check_tenant_queue(self, tenant: str) -> None:
        """Refuse a request of a tenant with ``max_waiting_per_tenant`` requests waiting
        already (requests without a tenant, the in-process API's, are not counted)."""
        bound = self.options.max_waiting_per_tenant
        if not tenant or not self.options.fair_share or bound <= 0:
            return
        queued = list(self.scheduler.waiting) + list(self._incoming)  # (an estimate)
        mine = sum(1 for s in queued if s.tenant == tenant)
        if mine >= bound:
            self.metrics.refused += 1
            raise TenantQueueFull(
                f"model {self.name}: {mine} requests of this client are waiting already "
                f"(max_waiting_per_tenant={bound}); retry when some have started",
                retry_after_s=1.0,
            )

    def first_token_wait(self, n_prompt: int) -> float:
        """A slow case (not the mean) of the time until a new request's first token: the
        rest of the step in progress, the steps that prefill the prompts ahead of it and
        its own, and, when the running batch is full, the decode steps until a sequence
        finishes; each step at the step model's ``tail`` and with every sequence ahead of
        it decoding beside it. Read from the loop thread without the lock: an estimate."""
        sched = self.scheduler
        model = self.step_model
        running = list(sched.running)
        waiting = list(sched.waiting) + list(self._incoming)  # (not yet taken by the loop)
        pending = n_prompt + sum(s.len_to_compute for s in waiting)
        pending += sum(s.len_to_compute for s in running if s.prefilling)
        decodes = sum(1 for s in running if not s.prefilling)
        batch = min(len(running) + len(waiting), sched.max_num_seqs)
        per_step = self.prefill_budget(batch) or sched.max_num_batched_tokens - decodes
        per_step = max(per_step, self.pool.block_size)
        steps = math.ceil(pending / per_step)
        wait = steps * model.time(batch, min(per_step, pending))
        over = len(running) + len(waiting) + 1 - sched.max_num_seqs
        if over > 0:  # it also waits for running sequences to finish
            left = sorted((s.max_len - len(s.tokens)) for s in running if not s.prefilling)
            if left:
                wait += left[min(over, len(left)) - 1] * model.time(decodes, 0)
        started, expected = self._step_started, self._step_expected
        if started:  # the step in progress ends first
            wait += max(0.0, expected - (time.perf_counter() - started))
        return wait * model.tail

    def prefill_budget(self, decodes: int) -> int | None:
        """Prompt tokens a step may run so that decoding sequences keep the inter-token
        objective (None: no objective)."""
        slo = self.options.slo
        if slo is None or slo.itl_p99_ms <= 0:
            return None
        return self.step_model.prefill_for(decodes, 0.8 * slo.itl_p99_ms / 1000)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str = "",
        priority: int = 0,
        tenant: str = "",
        checked: bool = False,
        prompt_logprobs: bool = False,
        speculate: bool = True,
    ) -> AsyncGenerator[GenerationEvent, None]:
        """The events of one generation, on the caller's event loop. Leaving the loop
        early (``aclose``, cancellation) aborts the sequence. ``checked``: the caller ran
        ``check_prompt`` (and admitted the request) already, before answering with a
        stream's status line; a second admission here could refuse it after that.
        ``prompt_logprobs`` (with ``params.logprobs``): the first event also carries each
        prompt token's logprob (the prompt runs whole, without the prefix cache).
        ``tenant``: whose fair share of the batch and the queue it counts in.
        ``speculate`` False: no speculative decoding for this one (the model's
        ``llm.speculative`` otherwise; never for a request that changes its logits:
        penalties, ``logit_bias``, ``min_tokens``, a constraint).

        ``params.n`` > 1: the events of every choice come from this one iterator, each with
        its ``index``, each choice ending with its own finished event; the prompt runs once
        and its KV blocks are shared by the choices (forked when its prefill ends)."""
        if not checked:
            self.check_prompt(len(prompt_ids), params, tenant=tenant)
        self.check_vocabulary(params)
        vocab = self.runner.vocab_size
        if not prompt_ids or min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidInput(f"prompt: expected token ids in [0, {vocab}), at least one")
        if self._stopping:
            raise ShuttingDown(f"model {self.name} is stopping")
        await self.check_constraint(params)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationEvent | BaseException] = asyncio.Queue()
        max_new = params.max_tokens or self.max_model_len - len(prompt_ids)
        family = [
            self._sequence(prompt_ids, params, i, max_new, (loop, queue)) for i in range(params.n)
        ]
        for seq in family:
            seq.priority, seq.request_id, seq.tenant = priority, request_id, tenant
            seq.speculate = speculate and not params.changes_logits
        first = family[0]
        first.forks = family[1:]
        if prompt_logprobs and params.logprobs is not None:
            text, raw = self.token_bytes(prompt_ids[0])  # (nothing predicts the first)
            first.prompt_logprobs = [TokenLogprob(text, None, [], raw, [])]
        self._submit(first)
        left = len(family)
        try:
            while True:
                for seq in family:
                    if seq.status == PAUSED and queue.empty():
                        self._resume(seq)  # (its events were all taken: it reads again)
                item = await queue.get()
                if isinstance(item, BaseException):
                    left = 0
                    raise item
                family[item.index].taken += 1
                if item.finished:
                    left -= 1
                yield item
                if not left:
                    return
        finally:
            if left:
                for seq in family:
                    if seq.finish_reason is None:
                        self.abort(seq)

    def _sequence(
        self, prompt_ids: list[int], params: SamplingParams, index: int, max_new: int, sink: Any
    ) -> Sequence:
        """Choice ``index`` of a request (``seed + index`` seeds its sampling)."""
        generator = new_generator(params, self.runner.device)
        if generator is not None and params.seed is not None and index:
            generator.manual_seed((params.seed + index) & 0xFFFF_FFFF_FFFF_FFFF)
        seq = Sequence(
            tokens=list(prompt_ids),
            num_prompt=len(prompt_ids),
            params=params,
            max_len=min(len(prompt_ids) + max_new, self.max_model_len),
            detok=Detokenizer(self.tokenizer, params.stop),
            arrival_ns=_now(),
            generator=generator,
            sink=sink,
            index=index,
        )
        if params.changes_logits:
            grammar = None
            if params.constraint is not None:
                grammar = self.grammars.state(params.constraint)
            seq.logits = RowLogits(
                params, prompt_ids, self.runner.vocab_size, sorted(self.runner.eos_ids), grammar
            )
        return seq

    def _submit(self, seq: Sequence) -> None:
        with self._lock:
            if self._failed is not None:
                raise InferenceFailed(f"model {self.name} failed: {self._failed}")
            self._incoming.append(seq)
            self._idle.clear()
        self._wake.set()

    def _resume(self, seq: Sequence) -> None:
        with self._lock:
            self._resumes.append(seq)
            self._idle.clear()
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        with self._lock:
            self._aborts.append(seq)
        self._wake.set()

    def _every_sequence(self) -> list[Sequence]:
        """Submitted, waiting, running and paused sequences (``_lock`` held)."""
        sched = self.scheduler
        return self._incoming + list(sched.waiting) + sched.running + sched.paused

    def abort_all(self, error: BaseException) -> None:
        """End every sequence now (a stop past its grace period): each consumer gets
        ``error``; the loop frees their blocks."""
        with self._lock:
            pending = self._every_sequence()
            self._aborts.extend(pending)
        for seq in pending:
            _send(seq, error)
        self._wake.set()

    # ---------------------------------------------------------------- the loop
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"llm-{self.name}", daemon=True)
        self._thread.start()

    def warmup(self, prompt_len: int = 64, new_tokens: int = 8, seqs: int = 4) -> None:
        """Run a few generations on this thread before serving: first-call costs, then the
        same again for the first samples of the step-time model (first calls would read as
        its slow tail)."""
        for seed in (0, 1):  # (other prompts the second time: no prefix-cache hits)
            self._warmup_round(prompt_len, new_tokens, seqs, seed)
            if seed == 0:
                self.step_model.clear()
        self.pool.queries = self.pool.hits = 0
        self.scheduler.preemptions = self.scheduler.fair_preemptions = 0  # (serving's only)
        release_openmp()  # (the step loop runs on its own thread)

    def _warmup_round(self, prompt_len: int, new_tokens: int, seqs: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        vocab = int(self.runner.model.config.vocab_size)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        room = self.pool.num_blocks * self.pool.block_size // 2 - new_tokens  # (small pools)
        for i in range(seqs):
            size = max(1, min(prompt_len * (i + 1) // seqs + 2, room))
            tokens = rng.integers(0, vocab, size=size).tolist()
            seq = Sequence(
                tokens=tokens,
                num_prompt=len(tokens),
                params=params,
                max_len=len(tokens) + new_tokens,
                detok=Detokenizer(self.tokenizer, ()),
            )
            self.scheduler.add(seq)
        while self.scheduler.has_work():
            self._step()

    def _run(self) -> None:
        try:
            while True:
                self._take_requests()
                if self._stopping:
                    for seq in list(self.scheduler.paused):  # admitted: they finish
                        self.scheduler.resume(seq)
                    if not self.scheduler.has_work():
                        break
                if not self.scheduler.has_work():
                    self._idle.set()
                    self._wake.wait()
                    self._wake.clear()
                    continue
                try:
                    self._step()
                except Exception as exc:  # the sequences in flight fail; the model serves on
                    log.exception("llm %s: a step failed", self.name)
                    self._fail_scheduled(
                        InferenceFailed(f"model {self.name}: {type(exc).__name__}: {exc}")
                    )
        except BaseException as exc:  # the loop itself ended: every sequence fails
            log.exception("llm %s: the step loop failed", self.name)
            with self._lock:
                self._failed = exc
            self._fail_all(InferenceFailed(f"model {self.name}: {type(exc).__name__}: {exc}"))
            if self.on_failed is not None:
                self.on_failed()  # (the version reads as not ready from now on)
        finally:
            self._idle.set()

    def _take_requests(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
            aborts, self._aborts = self._aborts, []
            resumes, self._resumes = self._resumes, []
        for seq in resumes:
            self.scheduler.resume(seq)  # (a finished one is not paused: left alone)
        for seq in incoming:
            try:
                self.scheduler.add(seq)
            except Exception as exc:  # this request fails; the others and the loop go on
                log.exception("llm %s: a request could not be scheduled", self.name)
                seq.status = FINISHED
                _send(seq, InferenceFailed(f"model {self.name}: {type(exc).__name__}: {exc}"))
        for seq in aborts:
            if seq.status != FINISHED:
                self._finish(seq, "abort")

    def _propose(self) -> None:
        """Draft tokens for the decoding sequences (speculative decoding), fewer as more
        decode (``speculative.draft_tokens``): beyond, one token each is cheaper."""
        spec = self.speculator
        if spec is None:
            return
        sched = self.scheduler
        decoding = [s for s in sched.running if not s.prefilling]
        k_max = spec.draft_tokens(len(decoding))
        if k_max <= 0:
            return
        for seq in decoding:
            # (the drafts and the model's own next token never pass max_len)
            k = min(k_max, seq.max_len - len(seq.tokens) - 1)
            if k <= 0 or not seq.speculate or seq.scoring_prompt:
                continue
            seq.draft, seq.draft_probs = spec.propose(
                seq.id, seq.tokens, k, seq.params, seq.generator
            )

    def _step(self) -> None:
        sched = self.scheduler
        self._pause_unread()
        decodes = sum(1 for s in sched.running if not s.prefilling)
        self._propose()
        step = sched.schedule(self.prefill_budget(decodes))
        if not step.items:
            time.sleep(0.001)
            return
        now = _now()
        for seq, _ in step.items:
            if not seq.scheduled_ns:
                seq.scheduled_ns = now
                if seq.sink is not None:
                    self.metrics.observe("queue", (now - seq.arrival_ns) / 1e9)
        rows = [
            i
            for i, (seq, n) in enumerate(step.items)
            if seq.computed + n == len(seq.tokens) + len(seq.draft)
        ]
        self._step_expected = self.step_model.time(step.decodes, step.prefill_tokens)
        self._step_started = started = time.perf_counter()
        sampling = [step.items[r][0] for r in rows]
        exact = [
            i
            for i, s in enumerate(sampling)
            if not s.params.greedy or s.params.logprobs is not None or s.logits is not None
        ]
        scoring, extra = _prompt_rows(step)
        # Drafted sequences: the logits at each drafted position too (after the prompts')
        drafted = [(r, s) for r, s in enumerate(sampling) if s.draft]
        extra_exact = [True] * len(extra)
        for r, seq in drafted:
            extra.append((rows[r], 0, len(seq.draft)))
            extra_exact.append(r in exact)
            seq.tokens.extend(seq.draft)  # (for this forward only)
        try:
            logits = self.runner.forward(step, rows, exact, extra, extra_exact)
        finally:
            for _, seq in drafted:
                del seq.tokens[len(seq.tokens) - len(seq.draft) :]
        plain = [r for r, s in enumerate(sampling) if not s.draft]
        sampled = _sample(logits[plain], [sampling[r] for r in plain])
        # A request's other choices start where its prompt's prefill ends: each draws its
        # first token from the same logits with its own generator
        forks = [(r, sampling[r]) for r in plain if sampling[r].forks and not sampling[r].generated]
        forked = [(r, seq, [c for c in seq.forks if c.status != FINISHED]) for r, seq in forks]
        fork_tokens = [_sample(logits[[r] * len(kids)], kids) for r, _, kids in forked]
        tokens: list[list[int]] = [[]] * len(rows)
        where: list[list[int]] = [[r] for r in range(len(rows))]  # logits row of each token
        for r, token in zip(plain, sampled, strict=True):
            tokens[r] = [token]
        at = len(rows) + sum(count for _, _, count in extra[: len(extra) - len(drafted)])
        for r, seq in drafted:
            k = len(seq.draft)
            where[r] = [*range(at, at + k), r]
            at += k
            tokens[r] = self._verify(seq, logits[where[r]])
        elapsed = time.perf_counter() - started
        self._step_started = 0.0
        self.step_model.add(step.decodes, step.prefill_tokens, elapsed)
        self.steps += 1
        end = _now()
        credit: dict[int, int] = {}  # a drafted sequence's tokens whose keys/values stay
        for row, (seq, new) in enumerate(zip(sampling, tokens, strict=True)):
            for j, token in enumerate(new):
                start = len(seq.detok.text)  # (where this token's text will begin)
                self._append(seq, token, end)
                if seq.params.logprobs is not None:
                    seq.new_logprobs.append(
                        logprobs_of(
                            logits[where[row][j]], token, seq.params.logprobs,
                            self.token_bytes, start,
                        )
                    )  # fmt: skip
                if seq.finish_reason is not None:
                    break
            if seq.draft:
                credit[seq.id] = min(len(new), j + 1)
        if credit:
            step = Step(
                [(s, credit.get(s.id, n)) for s, n in step.items], step.decodes,
                step.prefill_tokens,
            )  # fmt: skip
        sched.after_step(step)
        for _, seq in drafted:
            seq.draft, seq.draft_probs = [], None
            sched.trim(seq)
        children: list[Sequence] = []
        for (r, parent, kids), firsts in zip(forked, fork_tokens, strict=True):
            parent.forks = []
            for child, token in zip(kids, firsts, strict=True):
                sched.fork(parent, child)
                self._append(child, token, end)
                if child.params.logprobs is not None:
                    child.new_logprobs.append(
                        logprobs_of(logits[r], token, child.params.logprobs, self.token_bytes, 0)
                    )  # fmt: skip
                children.append(child)
        row = len(rows)
        for seq, targets in scoring:
            scored = logits[row : row + len(targets)]
            top = seq.params.logprobs or 0
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs += prompt_logprobs(scored, targets, top, self.token_bytes)
            row += len(targets)
        self._emit(sampling + children, step)

    def _verify(self, seq: Sequence, logits: Any) -> list[int]:
        """The tokens a drafted sequence keeps: ``logits`` [K + 1, vocab] at its last token
        and its K drafted ones (``speculative.verify_greedy`` / ``verify_sampled``)."""
        p = seq.params
        if p.greedy:
            out = verify_greedy(seq.draft, logits.argmax(dim=-1).tolist())
        else:
            out = verify_sampled(
                seq.draft, probabilities(logits, p), seq.draft_probs, seq.generator
            )
        self.metrics.drafted += len(seq.draft)
        self.metrics.accepted += len(out) - 1
        return out

    def _pause_unread(self) -> None:
        """Pause the sequences whose consumer has left an event untaken for
        ``unread_timeout_s`` (checked a few times per timeout): their blocks and slot go to
        others; taking its events resumes one (recomputed, as after a preemption)."""
        timeout = self.options.unread_timeout_s
        now = _now()
        if timeout <= 0 or now < self._next_stall_check or self._stopping:
            return
        self._next_stall_check = now + int(min(timeout / 4, 1.0) * 1e9)
        limit = now - int(timeout * 1e9)
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting]:
            oldest = seq.oldest_untaken_ns()
            if not oldest or oldest > limit:
                continue
            sched.pause(seq)
            if seq.taken >= seq.delivered:  # it took them meanwhile: it would not resume
                sched.resume(seq)
                continue
            self.stalled += 1
            log.info(
                "llm %s: paused a stream not read for %g s (request %s)",
                self.name, timeout, seq.request_id or "-",
            )  # fmt: skip

    def _append(self, seq: Sequence, token: int, now: int) -> None:
        seq.tokens.append(token)
        seq.new_tokens.append(token)
        if seq.first_token_ns == 0:
            seq.first_token_ns = now
            if seq.sink is not None:
                self.metrics.observe("ttft", (now - seq.arrival_ns) / 1e9)
        elif seq.sink is not None:
            self.metrics.observe("itl", (now - seq.last_token_ns) / 1e9)
        seq.last_token_ns = now
        p = seq.params
        changes = seq.logits
        if changes is not None:
            changes.accept(token)
        if (token in self.runner.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish_reason = "stop"  # (the token's text is not part of the answer)
            return
        if seq.detok.add(token):
            seq.finish_reason = "stop"
        elif changes is not None and changes.grammar is not None and changes.grammar.done:
            seq.finish_reason = "stop"  # (the grammar is complete: nothing more may follow)
        elif len(seq.tokens) >= seq.max_len:
            seq.finish_reason = "length"

    def _emit(self, sampled: list[Sequence], step: Step) -> None:
        by_loop: dict[Any, list[tuple[asyncio.Queue[Any], GenerationEvent]]] = defaultdict(list)
        now = _now()
        for seq in sampled:
            reason = seq.finish_reason
            if reason is not None:
                failed = _grammar_failure(seq) if reason == "stop" else None
                if failed is not None:  # (the answer would end cut, not complete)
                    self._finish(seq, "abort")
                    _send(seq, failed)
                    continue
                self._finish(seq, reason)
            if seq.sink is None:
                continue
            text = seq.detok.delta(final=reason is not None)
            event = GenerationEvent(
                text=text,
                token_ids=seq.new_tokens,
                prompt_tokens=seq.num_prompt,
                completion_tokens=seq.generated,
                finish_reason=reason,
                logprobs=_settled_logprobs(seq, reason is not None) or None,
                cached_tokens=seq.cached_tokens,
                prompt_logprobs=self._scored_prompt(seq),
                index=seq.index,
            )
            seq.new_tokens = []
            seq.oldest_untaken_ns()  # (forgets the times of the events taken)
            seq.untaken_ns.append(now)
            seq.delivered += 1
            loop, queue = seq.sink
            by_loop[loop].append((queue, event))
        for loop, events in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_deliver, events)

    def _scored_prompt(self, seq: Sequence) -> list[TokenLogprob] | None:
        """The prompt's logprobs, once all are computed and not yet handed out, with the
        offsets of their text."""
        scored = seq.prompt_logprobs
        if scored is None or seq.prompt_logprobs_sent or seq.scoring_prompt:
            return None
        seq.prompt_logprobs_sent = True
        offsets = text_offsets(self.tokenizer, seq.tokens[: seq.num_prompt])
        for entry, offset in zip(scored, offsets, strict=True):
            entry.offset = offset
        return scored

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq)
        if self.speculator is not None:
            self.speculator.forget(seq.id)
        seq.finish_reason = reason
        if seq.sink is None:
            return
        m = self.metrics
        m.finished[reason] += 1
        m.prompt_tokens += seq.num_prompt if not seq.index else 0  # (once per request)
        m.generated_tokens += seq.generated
        m.observe("prompt", seq.num_prompt)
        m.observe("generated", seq.generated)
        m.observe("e2e", (_now() - seq.arrival_ns) / 1e9)

    def _fail_scheduled(self, error: BaseException) -> None:
        """End every scheduled sequence with ``error`` and free its blocks."""
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting, *sched.paused]:
            self._finish(seq, "abort")
            _send(seq, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending = self._every_sequence()
            self._incoming = []
        for seq in pending:
            _send(seq, error)

    def _gauges(self) -> dict[str, float]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "paused": len(self.scheduler.paused),
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_total": self.pool.num_blocks,
        }

    def _counts(self) -> dict[str, int]:
        sched = self.scheduler
        return {
            "preempted": sched.preemptions,
            "fair_preempted": sched.fair_preemptions,
            "stalled": self.stalled,
        }

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    async def drain(self) -> None:
        while self.busy:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Finish admitted sequences, then end the loop."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)


def _sample(logits: Any, seqs: list[Sequence]) -> list[int]:
    """One token for each of ``seqs`` from its row of ``logits``."""
    if not seqs:
        return []
    params = [s.params for s in seqs]
    generators = [s.generator for s in seqs]
    changes = [s.logits for s in seqs]
    if any(c is not None for c in changes):
        return sample(logits, params, generators, changes)
    return sample(logits, params, generators)


def _grammar_failure(seq: Sequence) -> InvalidInput | None:
    """The error to answer when the sequence's grammar failed instead of completing."""
    grammar = getattr(seq.logits, "grammar", None)
    why = getattr(grammar, "error", None)
    if why is None:
        return None
    return InvalidInput(
        f"{GRAMMAR_FIELD}: the constraint failed after {seq.generated} generated tokens "
        f"({why}); expected one an answer can complete (a schema with a finite instance, a "
        "bounded pattern)"
    )


def _send(seq: Sequence, error: BaseException) -> None:
    """Hand ``error`` to the request's consumer on its own loop (gone: nobody listens)."""
    if seq.sink is not None:
        loop, queue = seq.sink
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(queue.put_nowait, error)


def _prompt_rows(step: Step) -> tuple[list[tuple[Sequence, list[int]]], list[tuple[int, int, int]]]:
    """The step's prompt positions whose logits score the next prompt token, for sequences
    whose prompt logprobs are asked for: (sequence, the tokens scored) and the runner's
    (item, start, count)."""
    scoring: list[tuple[Sequence, list[int]]] = []
    extra: list[tuple[int, int, int]] = []
    for item, (seq, n) in enumerate(step.items):
        if not seq.scoring_prompt:
            continue
        assert seq.prompt_logprobs is not None
        lo = max(seq.computed, len(seq.prompt_logprobs) - 1)  # (after a preemption: the rest)
        hi = min(seq.computed + n, seq.num_prompt - 1)
        if hi > lo:
            scoring.append((seq, seq.tokens[lo + 1 : hi + 1]))
            extra.append((item, lo - seq.computed, hi - lo))
    return scoring, extra


def _settled_logprobs(seq: Sequence, final: bool) -> list[TokenLogprob]:
    """The logprobs a step's event hands out: those of tokens whose text was handed out
    (a stop string can no longer cut it), or all of them at the end unless a stop string
    cut the text (the tokens past the cut are dropped)."""
    pending = seq.new_logprobs
    if not seq.params.stop or (final and not seq.detok.stopped):
        seq.new_logprobs = []
        return pending
    emitted = seq.detok.emitted
    settled = 0
    while settled < len(pending) and pending[settled].offset < emitted:
        settled += 1
    seq.new_logprobs = [] if final else pending[settled:]
    return pending[:settled]


def _deliver(events: list[tuple[asyncio.Queue[Any], GenerationEvent]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)


# Text longer than max_model_len x this many characters is measured by the tokens of that
# prefix first; refused when the prefix alone holds max_model_len + PREFIX_SLACK_TOKENS.
PREFIX_CHARS_PER_TOKEN = 8
PREFIX_SLACK_TOKENS = 16


def longest_token(tokenizer: Any) -> int:
    """The longest vocabulary entry of ``tokenizer``, in characters (byte-level BPE writes one
    character per byte, so this bounds the text one token stands for)."""
    try:
        return max(16, max(len(t) for t in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return 256
