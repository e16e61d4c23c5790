"""Defaults sized for the model rather than for one example.

``SamplingDefaults``: what a request that sets no ``temperature`` / ``top_p`` / ``top_k`` /
``max_tokens`` gets. The model's own recommendation comes first: the ``temperature``,
``top_p``, ``top_k`` and ``max_new_tokens`` its ``generation_config.json`` names (as vLLM
applies them by default; other fields there are not sampling rtserve takes from it); then
OpenAI's (temperature 1, top_p 1, no top-k). An answer's length is capped on the server
whatever the model says: at most ``llm.default_max_tokens`` (256) and what the context has
left, so one request without ``max_tokens`` cannot hold the batch for minutes.

``kv_pool_bytes``: the KV pool a model gets when its config sets no ``llm.kv_cache_bytes``:
enough for ``max_num_seqs`` sequences of ``max_model_len`` tokens, bounded by a fraction of
the memory available (and never below one full-length sequence).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtserve.runtime.llm.params import SamplingParams

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
# The share of available memory (CPU: MemAvailable; GPU: free device memory) an automatic KV
# pool may take, and its ceiling.
KV_MEMORY_FRACTION = 0.25
KV_MAX_BYTES = 8 << 30


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The model's defaults for what a request leaves unset (None: OpenAI's)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens
    source: str = ""  # where they came from (for the log)

    @classmethod
    def load(cls, version_dir: Path) -> SamplingDefaults:
        """The sampling ``version_dir/generation_config.json`` recommends; none when the
        file is absent, and a warning (then none) when it cannot be read."""
        path = Path(version_dir) / GENERATION_CONFIG
        if not path.is_file():
            return cls()
        try:
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            log.warning("llm %s: ignored (%s); no sampling defaults from it", path, exc)
            return cls()

        def number(key: str, lo: float, hi: float) -> float | None:
            value = doc.get(key)
            if value is None:
                return None
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (lo <= value <= hi)
            ):
                log.warning("llm %s: %s %r ignored (expected [%g, %g])", path, key, value, lo, hi)
                return None
            return float(value)

        top_k = number("top_k", 0, 1 << 20)
        new = number("max_new_tokens", 1, 1 << 20)
        return cls(
            temperature=number("temperature", 0.0, 2.0),
            top_p=number("top_p", 1e-6, 1.0),
            top_k=None if top_k is None else int(top_k),
            max_tokens=None if new is None else int(new),
            source=str(path),
        )

    def describe(self) -> str:
        """The defaults set, for the log (``temperature 0.2, top_p 0.9``), or ''."""
        names = ("temperature", "top_p", "top_k", "max_tokens")
        return ", ".join(f"{n} {getattr(self, n):g}" for n in names if getattr(self, n) is not None)

    def apply(
        self, params: SamplingParams, n_prompt: int, max_model_len: int, cap: int
    ) -> SamplingParams:
        """``params`` with what the request left unset filled in: the model's sampling, and
        an answer length of at most ``cap`` (``llm.default_max_tokens``) and what the context
        leaves after an ``n_prompt``-token prompt."""
        changes: dict[str, Any] = {}
        for name in params.unset:
            value = getattr(self, name)
            if value is not None:
                changes[name] = value
        if params.max_tokens is None:
            length = min(cap, max_model_len - n_prompt)
            if self.max_tokens is not None:
                length = min(length, self.max_tokens)
            changes["max_tokens"] = max(1, length)
        return dataclasses.replace(params, **changes) if changes else params


def available_memory(device: str = "cpu") -> int:
    """Bytes this process could still take: CUDA's free device memory, else the kernel's
    MemAvailable (bounded by a cgroup's limit), else 4 GiB when neither can be read."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    available = 4 << 30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            available = min(available, int(text))
        break
    return available


def kv_pool_bytes(
    bytes_per_token: int,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    device: str = "cpu",
    available: int | None = None,
) -> tuple[int, str]:
    """The KV pool for a config that sets no ``kv_cache_bytes``, and why (for the log):
    every sequence at full length (``max_num_seqs x max_model_len`` tokens), at most
    ``KV_MEMORY_FRACTION`` of the available memory (and ``KV_MAX_BYTES``), at least one
    full-length sequence."""
    override = os.environ.get("RTSERVE_KV_MEMORY_FRACTION")
    fraction = KV_MEMORY_FRACTION
    if override:
        try:
            fraction = min(0.95, max(0.01, float(override)))
        except ValueError:
            log.warning("RTSERVE_KV_MEMORY_FRACTION: expected a number, got %r", override)
    block = bytes_per_token * block_size
    blocks_per_seq = -(-max_model_len // block_size)
    want = blocks_per_seq * max_num_seqs * block
    free = available_memory(device) if available is None else available
    bound = min(int(free * fraction), KV_MAX_BYTES)
    one_seq = blocks_per_seq * block
    size = max(min(want, bound), one_seq)
    size = size // block * block
    why = (
        f"{max_num_seqs} sequences x {max_model_len} tokens x {bytes_per_token} B = {want >> 20} MiB"
        f", bounded by {fraction:g} of {free >> 20} MiB available"
    )
    return size, why
