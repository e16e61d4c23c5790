"""Iteration-level scheduling: which tokens of which sequences run in the next step.

Each step takes one token of every running sequence that is decoding, then chunks of
prompts (sequences admitted earlier first, then waiting ones by priority and arrival) up to
the step's token budget. Blocks come from the pool; when a decoding sequence needs a block
and none is free, the lowest-priority, latest sequence is preempted: its blocks are freed
(its full blocks stay in the prefix cache) and it waits to be recomputed, keeping the tokens
it has generated. Finished sequences free their blocks at once.

Fair share: each sequence belongs to a tenant (an API key's name, or a client's address).
While tenants wait, each tenant's quota of the running batch is ``max_num_seqs`` split by
weight among the tenants with running or waiting sequences (at least one slot each); waiting
sequences are admitted by priority, then from the tenant with the fewest running per weight;
a tenant below its quota with no free slot (or no free block) takes one from the tenant
furthest above its quota, whose newest sequence is preempted (never one more urgent than the
waiter). A lone tenant uses every slot. The scheduler reads no clock: it is a function of its
state, so tests drive it step by step.

Speculative decoding: a decoding sequence with drafted tokens runs them with its last token
(K + 1 slots) where the token budget and free blocks allow (its drafts are cut to fit, never
preempting for them); after the step the engine credits only the tokens the model kept and
``trim`` frees the blocks of the rejected ones.

Choices of one request (``n`` > 1): the first runs the prompt; when its prefill ends, each
other choice is forked from it (``fork``): it shares the prompt's full blocks (one more
reference each), computes the tokens of the last, partial block again (fewer than a block)
and decodes on its own.

A stream whose consumer stopped reading is paused: out of the batch and the queue, its blocks
freed, until it is resumed (then recomputed, as after a preemption).
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rtserve.runtime.llm.detok import Detokenizer
from rtserve.runtime.llm.kv import BlockPool, block_hashes
from rtserve.runtime.llm.params import SamplingParams, TokenLogprob

_ids = itertools.count()

WAITING, RUNNING, FINISHED, PAUSED = 0, 1, 2, 3


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
    tenant: str = ""  # whose share of the batch it counts in
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
    # Speculative decoding: tokens drafted for this step (verified in it, then cleared) and,
    # for a sampled sequence with a draft model, the distributions they were drawn from.
    draft: list[int] = field(default_factory=list)
    draft_probs: Any = None
    speculate: bool = True  # (a request may opt out of its model's speculative decoding)
    index: int = 0  # which of its request's choices
    forks: list[Sequence] = field(default_factory=list)  # choices to start after its prefill
    logits: Any = None  # its changes to its logits (``sampler.RowLogits``), if any
    # Events handed to the consumer (engine thread) and taken by it (its event loop), and
    # when each not yet taken was handed over: one left untaken too long is a stream nobody
    # reads.
    delivered: int = 0
    taken: int = 0
    untaken_ns: deque[int] = field(default_factory=deque)

    def oldest_untaken_ns(self) -> int:
        """When the oldest event its consumer has not taken was handed over (0: none); the
        engine thread's (it forgets the times of the events taken)."""
        untaken = self.untaken_ns
        pending = self.delivered - self.taken
        while len(untaken) > pending:
            untaken.popleft()
        return untaken[0] if untaken else 0

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
        fair_share: bool = True,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.fair_share = fair_share
        self.weights = dict(weights or {})  # tenant -> weight (others: 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused: list[Sequence] = []
        self.preemptions = 0  # for KV blocks
        self.fair_preemptions = 0  # for another tenant's share

    def tenant(self, seq: Sequence) -> str:
        """The tenant ``seq`` counts under (one for all when fair share is off)."""
        return seq.tenant if self.fair_share else ""

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def quotas(self) -> dict[str, int]:
        """Each active tenant's share of the running batch: ``max_num_seqs`` split by weight
        among the tenants with running or waiting sequences, at least one slot each."""
        active = {self.tenant(s) for s in self.running} | {self.tenant(s) for s in self.waiting}
        total = sum(self.weight(t) for t in active)
        return {t: max(1, int(self.max_num_seqs * self.weight(t) / total)) for t in active}

    def _running_counts(self) -> Counter[str]:
        return Counter(self.tenant(s) for s in self.running)

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """Whom to preempt: the least urgent; of those, from the tenant with the most running
        sequences per weight; of those, the newest."""
        counts = self._running_counts()
        return max(
            candidates,
            key=lambda s: (
                s.priority,
                counts[self.tenant(s)] / self.weight(self.tenant(s)),
                s.arrival_ns,
                s.id,
            ),
        )

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
            self._rebalance()
            step = self._schedule(prefill_budget)
            if step.items or not self.running:
                return step
            self.preempt(self._victim(self.running))

    def _rebalance(self) -> None:
        """Preempt for tenants waiting below their quota when no slot (or no block) is free:
        each time the newest sequence of the tenant furthest above its quota, never one more
        urgent than the waiter's next sequence."""
        if not self.waiting or not self.fair_share:
            return
        waiting = self._admission_order()
        counts = self._running_counts()
        if len(waiting.keys() | counts.keys()) < 2:
            return  # a lone tenant uses every slot
        quotas = self.quotas()
        free_slots = self.max_num_seqs - len(self.running)
        free_blocks = self.pool.num_free
        order = sorted(waiting, key=lambda t: (waiting[t][0].priority, counts[t] / self.weight(t)))
        for t in order:
            # Its next sequences, up to its quota, each take a free slot or someone's.
            for waiter in list(waiting[t])[: max(quotas[t] - counts[t], 0)]:
                if free_slots > 0 and free_blocks > 0:
                    free_slots -= 1
                    free_blocks -= 1  # (its first chunk takes a block at least)
                    continue
                over = [
                    s
                    for s in self.running
                    if counts[self.tenant(s)] > quotas[self.tenant(s)]
                    and s.priority >= waiter.priority
                ]
                if not over:
                    break
                victim = self._victim(over)
                counts[self.tenant(victim)] -= 1
                free_blocks += len(victim.blocks) - 1
                self.preempt(victim, fair=True)

    def _admission_order(self) -> dict[str, deque[Sequence]]:
        """The waiting sequences of each tenant, in queue order."""
        queues: dict[str, deque[Sequence]] = {}
        for s in self.waiting:
            queues.setdefault(self.tenant(s), deque()).append(s)
        return queues

    def _schedule(self, prefill_budget: int | None) -> Step:
        decoding = [s for s in self.running if not s.prefilling]
        for seq in decoding:
            if seq.status == RUNNING and not self._reserve(seq, 1):
                self._make_room(seq)
        items: list[tuple[Sequence, int]] = []
        decoding = [s for s in self.running if s.status == RUNNING and not s.prefilling]
        budget = self.max_num_batched_tokens - len(decoding)
        for seq in decoding:
            items.append((seq, 1 + self._draft_room(seq, budget)))
            budget -= items[-1][1] - 1
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
        if self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            self._admit(items, budget)
        items.sort(key=lambda item: item[1] != 1)
        decodes = sum(1 for _, n in items if n == 1)
        return Step(items, decodes, sum(n for _, n in items) - decodes)

    def _draft_room(self, seq: Sequence, budget: int) -> int:
        """How many of its drafted tokens a decoding sequence runs this step (K + 1 token
        slots): as many as the token budget and the free blocks allow, never preempting
        for them; the drafts beyond are dropped."""
        if not seq.draft:
            return 0
        bs = self.pool.block_size
        room = (len(seq.blocks) + self.pool.num_free) * bs - seq.computed - 1
        k = max(0, min(len(seq.draft), budget, room))
        if k and not self._reserve(seq, 1 + k):
            k = 0
        del seq.draft[k:]
        if seq.draft_probs is not None:
            seq.draft_probs = seq.draft_probs[:k] if k else None
        return k

    def _admit(self, items: list[tuple[Sequence, int]], budget: int) -> None:
        """Admit waiting sequences while slots, blocks and the token budget allow: the most
        urgent first; among equals, the next of the tenant with the fewest running per
        weight; among those, in queue order."""
        queues = self._admission_order()
        order = {s.id: i for i, s in enumerate(self.waiting)}
        counts = self._running_counts()
        while queues and budget > 0 and len(self.running) < self.max_num_seqs:
            tenant = min(
                queues,
                key=lambda t: (
                    queues[t][0].priority,
                    counts[t] / self.weight(t),
                    order[queues[t][0].id],
                ),
            )
            seq = queues[tenant][0]
            self._admit_prefix(seq)
            n = self._chunk(seq, budget)
            if n == 0:
                self._release(seq)
                break
            queues[tenant].popleft()
            if not queues[tenant]:
                del queues[tenant]
            if self.waiting[0] is seq:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            counts[tenant] += 1
            seq.status = RUNNING
            self.running.append(seq)
            items.append((seq, n))
            budget -= n

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
            victim = self._victim([s for s in self.running if s.status == RUNNING])
            self.preempt(victim)
            if victim is needy or self._reserve(needy, 1):
                return

    def preempt(self, seq: Sequence, fair: bool = False) -> None:
        """Free a running sequence's blocks; it waits first in line to be recomputed.
        ``fair``: for another tenant's share (else for KV blocks)."""
        self._release(seq)
        seq.status = WAITING
        seq.preemptions += 1
        if fair:
            self.fair_preemptions += 1
        else:
            self.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` (the same prompt as ``parent``, whose prefill just ended): it
        takes ``parent``'s full prompt blocks (one more reference each) and waits first in
        line to compute the rest."""
        bs = self.pool.block_size
        full = min(parent.computed, child.num_prompt) // bs
        child.blocks = parent.blocks[:full]
        for index in child.blocks:
            self.pool.blocks[index].refs += 1
        child.computed = full * bs
        child.hashed = min(parent.hashed, full)
        child.last_hash = parent.last_hash if child.hashed == parent.hashed else 0
        if child.hashed != parent.hashed:  # (cannot happen: no chain hash to go on from)
            child.hashed = 0
        child.cached_tokens = parent.cached_tokens
        child.admitted = True
        child.status = WAITING
        self.waiting.appendleft(child)

    def pause(self, seq: Sequence) -> None:
        """Take a running or waiting sequence out of the batch and the queue, its blocks
        freed, until :meth:`resume`."""
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        else:
            return
        self._release(seq)
        seq.status = PAUSED
        self.paused.append(seq)

    def resume(self, seq: Sequence) -> None:
        """Queue a paused sequence again (it is recomputed when admitted)."""
        if seq.status != PAUSED:
            return
        self.paused.remove(seq)
        seq.status = WAITING
        self.add(seq)

    def _release(self, seq: Sequence) -> None:
        seq.draft = []
        seq.draft_probs = None
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

    def trim(self, seq: Sequence) -> None:
        """Free a running sequence's blocks past its computed tokens and its next one: the
        slots of drafted tokens the model rejected (their keys and values are stale)."""
        keep = self.pool.blocks_for(seq.computed + 1)
        if seq.status == RUNNING and len(seq.blocks) > keep:
            self.pool.free(seq.blocks[keep:])
            del seq.blocks[keep:]

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks now."""
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status == PAUSED:
            self.paused.remove(seq)
        self._release(seq)
        seq.status = FINISHED
