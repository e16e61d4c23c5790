"""Iteration-level scheduling: which tokens of which sequences run in the next step.

Each step takes one token of every running sequence that is decoding, then chunks of
prompts (sequences admitted earlier first, then waiting ones by priority and arrival) up to
the step's token budget. Blocks come from the pool; when a decoding sequence needs a block
and none is free, the lowest-priority, latest sequence is preempted: its blocks are freed
(its full blocks stay in the prefix cache) and it waits to be recomputed, keeping the tokens
it has generated. Finished sequences free their blocks at once.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rtserve.llm.detok import Detokenizer
from rtserve.llm.kv import BlockPool, block_hashes
from rtserve.llm.params import SamplingParams, TokenLogprob

_ids = itertools.count()

WAITING, RUNNING, FINISHED = 0, 1, 2


@dataclass(eq=False, slots=True)
class Sequence:
    """One request's tokens and where its keys and values live."""

    tokens: list[int]
    num_prompt: int
    params: SamplingParams
    max_len: int  # prompt + tokens it may generate
    detok: Detokenizer
    priority: int = 0  # lower runs first
    arrival_ns: int = 0
    request_id: str = ""
    generator: torch.Generator | None = None
    sink: Any = None  # where events go (the engine's)
    id: int = field(default_factory=lambda: next(_ids))
    status: int = WAITING
    computed: int = 0  # tokens whose keys/values are in the pool
    blocks: list[int] = field(default_factory=list)
    hashed: int = 0  # full blocks registered in the prefix cache
    last_hash: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache at first admission
    admitted: bool = False
    aborted: bool = False
    first_token_ns: int = 0
    last_token_ns: int = 0
    scheduled_ns: int = 0
    finish_reason: str | None = None
    new_tokens: list[int] = field(default_factory=list)  # since the last event
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet handed out
    # Asked for: each prompt token's logprob, computed as the prompt's chunks run.
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False
    preemptions: int = 0

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def prefilling(self) -> bool:
        return self.len_to_compute > 1

    @property
    def scoring_prompt(self) -> bool:
        """Its prompt's logprobs are asked for and not all computed yet."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt

    @property
    def len_to_compute(self) -> int:
        return len(self.tokens) - self.computed


@dataclass(slots=True)
class Step:
    """The next step: ``items`` (sequence, tokens to run) with single-token items first."""

    items: list[tuple[Sequence, int]]
    decodes: int
    prefill_tokens: int

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefill_tokens


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence, after those of the same or a higher priority."""
        if not self.waiting or self.waiting[-1].priority <= seq.priority:
            self.waiting.append(seq)
            return
        for i, other in enumerate(self.waiting):
            if other.priority > seq.priority:
                self.waiting.insert(i, seq)
                return

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_budget: int | None = None) -> Step:
        """The next step. ``prefill_budget``: the most prompt tokens to run alongside the
        decodes (the token objective's limit); None: the token budget's remainder.

        When the sequences holding blocks cannot go on (half-computed prompts filled the
        pool), the lowest-priority, latest is preempted until one can."""
        while True:
            step = self._schedule(prefill_budget)
            if step.items or not self.running:
                return step
            self.preempt(max(self.running, key=lambda s: (s.priority, s.arrival_ns, s.id)))

    def _schedule(self, prefill_budget: int | None) -> Step:
        decoding = [s for s in self.running if not s.prefilling]
        for seq in decoding:
            if seq.status == RUNNING and not self._reserve(seq, 1):
                self._make_room(seq)
        items = [(s, 1) for s in self.running if s.status == RUNNING and not s.prefilling]
        budget = self.max_num_batched_tokens - len(items)
        if prefill_budget is not None:
            budget = min(budget, max(prefill_budget, 0))
        if not items:
            budget = max(budget, self.pool.block_size)  # always make progress
        for seq in [s for s in self.running if s.prefilling]:
            if budget <= 0:
                break
            n = self._chunk(seq, budget)
            if n:
                items.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self._admit_prefix(seq)
            n = self._chunk(seq, budget)
            if n == 0:
                self._release(seq)
                break
            self.waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)
            items.append((seq, n))
            budget -= n
        items.sort(key=lambda item: item[1] != 1)
        decodes = sum(1 for _, n in items if n == 1)
        return Step(items, decodes, sum(n for _, n in items) - decodes)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Reserve blocks for as much of the sequence's remaining prompt as fits."""
        n = min(seq.len_to_compute, budget)
        while n > 0 and not self._reserve(seq, n):
            # Fit what the free blocks hold instead.
            room = (len(seq.blocks) + self.pool.num_free) * self.pool.block_size - seq.computed
            n = min(n - 1, room)
        return max(n, 0)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        need = self.pool.blocks_for(seq.computed + n) - len(seq.blocks)
        if need > self.pool.num_free:
            return False
        for _ in range(need):
            seq.blocks.append(self.pool.allocate())
        return True

    def _admit_prefix(self, seq: Sequence) -> None:
        """Take cached blocks for the sequence's leading full blocks (at least one token
        is left to compute: its logits give the next token)."""
        if seq.blocks or not self.pool.prefix_caching:
            return
        if seq.scoring_prompt:  # (it runs whole: each prompt position's logits are needed)
            seq.admitted = True
            return
        bs = self.pool.block_size
        usable = (len(seq.tokens) - 1) // bs
        hashes = block_hashes(seq.tokens[: usable * bs], bs)
        found = self.pool.lookup(hashes)
        if found:
            seq.blocks = found
            seq.computed = len(found) * bs
            seq.hashed = len(found)
            seq.last_hash = hashes[len(found) - 1]
        if not seq.admitted:
            seq.cached_tokens = seq.computed
            seq.admitted = True

    def _make_room(self, needy: Sequence) -> None:
        """Preempt the lowest-priority, latest running sequences until ``needy`` has its
        block (``needy`` itself may be the one preempted)."""
        while True:
            victim = max(
                (s for s in self.running if s.status == RUNNING),
                key=lambda s: (s.priority, s.arrival_ns, s.id),
            )
            self.preempt(victim)
            if victim is needy or self._reserve(needy, 1):
                return

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.computed = 0
        seq.hashed = 0
        seq.last_hash = 0

    def after_step(self, step: Step) -> None:
        """Account the computed tokens and register newly full blocks for prefix reuse."""
        bs = self.pool.block_size
        for seq, n in step.items:
            seq.computed += n
            full = seq.computed // bs
            if self.pool.prefix_caching and full > seq.hashed:
                hashes = block_hashes(
                    seq.tokens[: full * bs], bs, start=seq.hashed, parent=seq.last_hash
                )
                for b, h in zip(range(seq.hashed, full), hashes, strict=True):
                    self.pool.register(seq.blocks[b], h)
                seq.hashed, seq.last_hash = full, hashes[-1]

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks now."""
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = FINISHED
