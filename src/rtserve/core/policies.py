"""The scheduling policies: ``config`` -> the policy that decides a version's batches.

``POLICIES`` is one table: each entry builds its policy for a loaded, warmed runtime and
says which config section selects it (``slo:``); a model may also name one
(``scheduling_policy: <name>``); else ``window``. Adding a policy is one module under
``scheduling/`` and one line here; the batcher, dataplane, cache and metrics are unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rtserve.config import ModelConfig, shown_value
from rtserve.core.warmup import Warmed, slo_controller
from rtserve.errors import ConfigError
from rtserve.runtime.base import Runtime
from rtserve.scheduling.base import SchedulingPolicy
from rtserve.scheduling.policy import DynamicBatchPolicy
from rtserve.scheduling.slo_policy import SLOPolicy
from rtserve.scheduling.window import WindowPolicy


@dataclass(frozen=True, slots=True)
class PolicyInput:
    """What building a policy may use: the loaded runtime, its config (with the runtime's
    max_batch_size), what warmup measured, and the frontends' "more expected" hint."""

    runtime: Runtime
    config: ModelConfig
    version_dir: Path
    warmed: Warmed
    more_expected: Callable[[], bool]


def _window(given: PolicyInput) -> SchedulingPolicy:
    """The fixed gathering window (Triton-style), the default."""
    config = given.config
    batching = config.dynamic_batching
    return WindowPolicy(
        DynamicBatchPolicy(config.max_batch_size, batching),
        batching.max_queue_size,
        given.more_expected,
    )


def _slo(given: PolicyInput) -> SchedulingPolicy:
    """The latency objective (``slo:``), calibrated with timed batches up to
    max_batch_size (off the event loop: the caller runs this on a thread)."""
    config = given.config
    try:  # a model may fail at sizes where warmup did not
        controller = slo_controller(given.runtime, config, given.warmed.fill)
    except Exception as exc:
        raise ConfigError(
            f"{given.version_dir}: slo: timing batches for the latency objective failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    max_queue = config.dynamic_batching.max_queue_size
    return SLOPolicy(controller, max(1, config.max_batch_size), max_queue)


@dataclass(frozen=True, slots=True)
class Policy:
    """One scheduling policy: ``build`` makes it (on a worker thread: it may time
    batches); ``selected`` says whether a config's own section asks for it (None: only
    when named by ``scheduling_policy``)."""

    build: Callable[[PolicyInput], SchedulingPolicy]
    selected: Callable[[ModelConfig], bool] | None = None


DEFAULT_POLICY = "window"
POLICIES: dict[str, Policy] = {
    "window": Policy(_window),
    "slo": Policy(_slo, lambda config: config.slo is not None),
}


def policy_name(config: ModelConfig) -> str:
    """The policy the config names (``scheduling_policy``), else the first whose section
    the config sets, else ``DEFAULT_POLICY``."""
    if config.scheduling_policy:
        if config.scheduling_policy not in POLICIES:
            raise ConfigError(
                f"{config.source}: scheduling_policy: expected one of {', '.join(POLICIES)}, "
                f"got {shown_value(config.scheduling_policy)}"
            )
        return config.scheduling_policy
    chosen = (n for n, p in POLICIES.items() if p.selected is not None and p.selected(config))
    return next(chosen, DEFAULT_POLICY)


async def build_policy(given: PolicyInput) -> SchedulingPolicy:
    """The config's policy, built off the event loop."""
    policy = POLICIES[policy_name(given.config)]
    return await asyncio.get_running_loop().run_in_executor(None, policy.build, given)
