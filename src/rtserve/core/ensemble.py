"""Ensembles: a model whose requests run a DAG of other models (``backend: ensemble``).

Each step names a model (and optionally a version) and maps the step model's inputs and
outputs to the ensemble's tensors::

    steps:
      - model: tokenizer
        inputs:  {text: TEXT}                 # step input -> ensemble tensor
        outputs: {input_ids: IDS, attention_mask: MASK}
      - model: minilm
        inputs:  {input_ids: IDS, attention_mask: MASK}
        outputs: {embedding: EMBEDDING}

The structure (fields, one producer per tensor, no cycle, every consumed tensor produced)
is checked from the config alone; names, datatypes, shapes and batching are checked against
the live step models when the ensemble is built (the registry loads ensembles last).

A request runs the steps level by level (a level = the steps whose inputs are all known);
each step goes through its own model's ``submit`` and so through that model's batcher,
where it batches with the step requests of other ensemble calls and with direct callers.
The steps of one level run concurrently. Step models are looked up on every call, so a
step model that is reloaded is picked up; the ensemble is ready only while every step is.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rtserve.config import AUTO_BATCH, ModelConfig, TensorSpec, _Fields, shown_value
from rtserve.core.model import BuildContext, ModelVersion, Outputs
from rtserve.errors import (
    ConfigError,
    DeadlineExceeded,
    InferenceFailed,
    ModelNotReady,
    Overloaded,
    RTServeError,
    ShuttingDown,
)
from rtserve.observability.metrics import outcome_of
from rtserve.protocol.types import Timings
from rtserve.runtime.parameters import RowParameter, row_feeds

_now = time.perf_counter_ns


@dataclass(frozen=True, slots=True)
class EnsembleStep:
    """One parsed step: ``inputs``/``outputs`` map the step model's names to tensors."""

    index: int
    model: str
    version: str  # "" = the model's latest version
    inputs: dict[str, str]
    outputs: dict[str, str]

    @property
    def where(self) -> str:
        return f"steps[{self.index}]"

    @property
    def label(self) -> str:
        return f"steps[{self.index}] (model '{self.model}')"


@dataclass(frozen=True, slots=True)
class Plan:
    """The parsed DAG: steps grouped in levels that can run one after the other."""

    steps: tuple[EnsembleStep, ...]
    levels: tuple[tuple[EnsembleStep, ...], ...]
    producer: dict[str, EnsembleStep]  # tensor -> the step that produces it


def step_models(config: ModelConfig) -> list[str]:
    """The model names an ensemble's steps call, read from its raw steps (no checks)."""
    names = (s.get("model") for s in config.steps if isinstance(s, dict))
    return list(dict.fromkeys(n for n in names if isinstance(n, str) and n))


def find_cycle(name: str, calls: Callable[[str], list[str]]) -> list[str] | None:
    """A chain of models from ``name`` back to itself (``calls``: the models a model's steps
    call, [] for a model that is not an ensemble), or None."""
    seen: set[str] = set()

    def visit(model: str, chain: list[str]) -> list[str] | None:
        for step in calls(model):
            if step == name:
                return [*chain, step]
            if step not in seen:
                seen.add(step)
                found = visit(step, [*chain, step])
                if found:
                    return found
        return None

    return visit(name, [name])


def cycle_error(where: str, chain: list[str]) -> ConfigError:
    return ConfigError(
        f"{where}: steps: cycle: {' -> '.join(chain)} (an ensemble cannot call itself, "
        "directly or through other ensembles)"
    )


def _mapping(f: _Fields, key: str) -> dict[str, str]:
    value = f.get(key)
    if not isinstance(value, dict) or not value:
        raise f.fail(key, "a non-empty mapping of step tensor name -> ensemble tensor name", value)
    for k, v in value.items():
        if not isinstance(k, str) or not k or not isinstance(v, str) or not v:
            raise ConfigError(
                f"{f.where}: {f.path(key)}: expected names (strings) on both sides, "
                f"got {shown_value(k)}: {shown_value(v)}"
            )
    return dict(value)


def parse_steps(config: ModelConfig) -> Plan:
    """Check the steps' structure (no live models needed) and order them in levels."""
    where = config.source
    if config.inputs is None or config.outputs is None:
        missing = "inputs" if config.inputs is None else "outputs"
        raise ConfigError(
            f"{where}: {missing}: required for backend ensemble (a list of {{name, datatype, shape}})"
        )
    ensemble_inputs = {s.name for s in config.inputs}
    steps: list[EnsembleStep] = []
    producer: dict[str, EnsembleStep] = {}
    for i, raw in enumerate(config.steps):
        f = _Fields(raw, where, f"steps[{i}]")
        model = f.string("model", "")
        if not model:
            raise f.fail("model", "the name of a model in the repository", f.get("model"))
        version = f.get("version", "")
        if isinstance(version, bool) or not isinstance(version, int | str):
            raise f.fail("version", "a version number", version)
        if isinstance(version, int) and version < 1:
            raise f.fail("version", "a version number >= 1", version)
        step = EnsembleStep(i, model, str(version), _mapping(f, "inputs"), _mapping(f, "outputs"))
        f.check_unknown()
        if model == config.name:
            raise f.fail("model", "another model (an ensemble cannot call itself)", model)
        for out, tensor in step.outputs.items():
            field = f"{where}: {step.where}.outputs.{out}"
            if tensor in ensemble_inputs:
                raise ConfigError(f"{field}: tensor '{tensor}' is an ensemble input; a step "
                                  "cannot produce it")  # fmt: skip
            other = producer.get(tensor)
            if other is not None:
                raise ConfigError(
                    f"{field}: tensor '{tensor}' is already produced by {other.label}"
                )
            producer[tensor] = step
        steps.append(step)
    for step in steps:
        for name, tensor in step.inputs.items():
            if tensor not in producer and tensor not in ensemble_inputs:
                raise ConfigError(
                    f"{where}: {step.where}.inputs.{name}: tensor '{tensor}' is produced by no "
                    f"step and is not an ensemble input (inputs: {', '.join(sorted(ensemble_inputs))})"
                )
    for i, spec in enumerate(config.outputs):
        if spec.name not in producer:
            raise ConfigError(
                f"{where}: outputs[{i}].name: ensemble output '{spec.name}' is produced by no step"
            )
    return Plan(tuple(steps), _levels(steps, producer, where), producer)


def _levels(
    steps: list[EnsembleStep], producer: dict[str, EnsembleStep], where: str
) -> tuple[tuple[EnsembleStep, ...], ...]:
    deps = {s.index: {producer[t].index for t in s.inputs.values() if t in producer} for s in steps}
    done: set[int] = set()
    levels: list[tuple[EnsembleStep, ...]] = []
    while len(done) < len(steps):
        ready = tuple(s for s in steps if s.index not in done and deps[s.index] <= done)
        if not ready:
            raise ConfigError(f"{where}: {_describe_cycle(steps, deps, done, producer)}")
        levels.append(ready)
        done.update(s.index for s in ready)
    return tuple(levels)


def _describe_cycle(
    steps: list[EnsembleStep],
    deps: dict[int, set[int]],
    done: set[int],
    producer: dict[str, EnsembleStep],
) -> str:
    """Follow unfinished dependencies until a step repeats; name the field that closes it."""
    by_index = {s.index: s for s in steps}
    path = [next(s.index for s in steps if s.index not in done)]
    while True:
        nxt = min(d for d in deps[path[-1]] if d not in done)
        if nxt in path:
            cycle = path[path.index(nxt) :] + [nxt]
            break
        path.append(nxt)
    # Name the field of the first step (in config order) on the cycle.
    at = cycle.index(min(cycle[:-1]))
    last, first = by_index[cycle[at]], by_index[cycle[at + 1]]
    name, tensor = next(
        (n, t) for n, t in last.inputs.items() if t in producer and producer[t] is first
    )
    ring = cycle[at:-1] + cycle[:at] + [cycle[at]]
    chain = " -> ".join(f"steps[{i}]" for i in reversed(ring))
    return (
        f"{last.where}.inputs.{name}: cycle: tensor '{tensor}' comes from {first.where}, "
        f"which depends on {last.where} ({chain})"
    )


# ---------------------------------------------------------------------- live checks
def _shapes_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b, strict=True))


def check_against_models(config: ModelConfig, plan: Plan, models: dict[int, ModelVersion]) -> int:
    """Check every step against its live model; return the ensemble's max_batch_size."""
    where = config.source
    batched = [mv.config.max_batch_size > 0 for mv in models.values()]
    if config.max_batch_size != AUTO_BATCH and (config.max_batch_size > 0) != all(batched):
        for step in plan.steps:
            mv = models[step.index]
            if (mv.config.max_batch_size > 0) != (config.max_batch_size > 0):
                raise ConfigError(
                    f"{where}: {step.where}.model: model '{mv.name}' has max_batch_size "
                    f"{mv.config.max_batch_size} but the ensemble's max_batch_size is "
                    f"{config.max_batch_size} (steps must batch exactly when the ensemble does)"
                )
    if any(batched) != all(batched):
        step = next(s for s in plan.steps if models[s.index].config.max_batch_size <= 0)
        raise ConfigError(
            f"{where}: {step.where}.model: model '{step.model}' does not batch but other "
            "steps do (steps must all batch or all not)"
        )
    max_batch = min(mv.config.max_batch_size for mv in models.values()) if all(batched) else 0
    if config.max_batch_size != AUTO_BATCH:
        for step in plan.steps:
            mv = models[step.index]
            if 0 < mv.config.max_batch_size < config.max_batch_size:
                raise ConfigError(
                    f"{where}: max_batch_size: {config.max_batch_size} exceeds the "
                    f"max_batch_size {mv.config.max_batch_size} of {step.label}"
                )
        max_batch = config.max_batch_size
    # The spec of every tensor: ensemble inputs as declared, the rest from their producer.
    specs: dict[str, tuple[TensorSpec, str]] = {
        s.name: (s, f"ensemble input '{s.name}'") for s in config.inputs or ()
    }
    for step in plan.steps:
        check_step(config, step, models[step.index])
        mv = models[step.index]
        for out, tensor in step.outputs.items():
            specs[tensor] = (mv.outputs[out], f"{step.label} output '{out}'")
    for step in plan.steps:
        mv = models[step.index]
        for name, tensor in step.inputs.items():
            have, origin = specs[tensor]
            want = mv.inputs[name]
            field = f"{where}: {step.where}.inputs.{name}"
            if have.datatype != want.datatype:
                raise ConfigError(
                    f"{field}: tensor '{tensor}' is {have.datatype} ({origin}) but model "
                    f"'{mv.name}' input '{name}' expects {want.datatype}"
                )
            if not _shapes_agree(have.shape, want.shape):
                raise ConfigError(
                    f"{field}: tensor '{tensor}' has shape {list(have.shape)} ({origin}) but "
                    f"model '{mv.name}' input '{name}' expects {list(want.shape)}"
                )
    for i, spec in enumerate(config.outputs or ()):
        have, origin = specs[spec.name]
        if have.datatype != spec.datatype:
            raise ConfigError(
                f"{where}: outputs[{i}].datatype: ensemble output '{spec.name}' is declared "
                f"{spec.datatype} but {origin} is {have.datatype}"
            )
        if not _shapes_agree(have.shape, spec.shape):
            raise ConfigError(
                f"{where}: outputs[{i}].shape: ensemble output '{spec.name}' is declared "
                f"{list(spec.shape)} but {origin} has shape {list(have.shape)}"
            )
    return max_batch


def check_step(config: ModelConfig, step: EnsembleStep, mv: ModelVersion) -> None:
    """The step's mapped names exist on its model and every model input is fed."""
    where = config.source
    for name in step.inputs:
        if name not in mv.inputs:
            raise ConfigError(
                f"{where}: {step.where}.inputs.{name}: model '{mv.name}' has no input "
                f"'{name}' (its inputs: {', '.join(mv.inputs)})"
            )
    for name in step.outputs:
        if name not in mv.outputs:
            raise ConfigError(
                f"{where}: {step.where}.outputs.{name}: model '{mv.name}' has no output "
                f"'{name}' (its outputs: {', '.join(mv.outputs)})"
            )
    unfed = [n for n in mv.inputs if n not in step.inputs]
    if unfed:
        raise ConfigError(
            f"{where}: {step.where}.inputs: model '{mv.name}' input '{unfed[0]}' is not "
            f"mapped to a tensor (every input of the step model must be)"
        )


# ---------------------------------------------------------------------- running
# Runtimes that never write their inputs (the others run user code on them).
_READ_ONLY_PLATFORMS = frozenset({"onnxruntime_onnx", "litert_tflite", "ensemble"})


def _check_shape(
    arr: np.ndarray, spec: TensorSpec, batched: bool, ensemble: str, label: str, tensor: str
) -> None:
    """A tensor's shape at run time against the declared one (-1: any size there)."""
    if not _shapes_agree(arr.shape[1:] if batched else arr.shape, spec.shape):
        shown = [-1, *spec.shape] if batched else list(spec.shape)
        raise InferenceFailed(
            f"ensemble '{ensemble}' {label}: tensor '{tensor}' has shape {list(arr.shape)}, "
            f"where {shown} is declared (a step produced a shape its consumer does not take)"
        )


def _version_print(mv: ModelVersion) -> str:
    """A short digest of a loaded version: its name, version, config and the names, sizes
    and times of its files (a nested ensemble: its own steps' too)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{mv.name}\0{mv.version}\0{mv.config!r}".encode())
    directory = Path(mv.config.source).parent / mv.version
    with contextlib.suppress(OSError):
        for p in sorted(directory.rglob("*")):
            if "__pycache__" not in p.parts and p.is_file():
                st = p.stat()
                h.update(f"{p.relative_to(directory)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    if isinstance(mv.scheduler, EnsembleScheduler):
        h.update(mv.scheduler.cache_salt().encode())
    return h.hexdigest()


def _step_error(ensemble: str, step: EnsembleStep, exc: BaseException) -> RTServeError:
    """The step's error with the step named; its class (and so its status) is kept."""
    prefix = f"ensemble '{ensemble}' {step.label}: "
    if isinstance(exc, RTServeError):
        named = copy.copy(exc)
        named.message = prefix + exc.message
        named.args = (named.message,)
        return named
    return InferenceFailed(f"{prefix}failed ({type(exc).__name__})")


class EnsembleScheduler:
    """Runs each request's DAG as one task; implements ``core.model.VersionScheduler``."""

    def __init__(
        self,
        config: ModelConfig,
        plan: Plan,
        lookup: Callable[[str, str], ModelVersion],
        checked: dict[int, ModelVersion],
        on_done: Callable[[int, int], None] | None = None,
    ) -> None:
        self.name = config.name
        self._config = config
        self._plan = plan
        self._lookup = lookup
        self._checked = checked  # step index -> the version last checked against the plan
        self._outputs = tuple(s.name for s in config.outputs or ())
        self._max_in_flight = config.dynamic_batching.max_queue_size
        self._on_done = on_done
        self._tasks: set[asyncio.Task[None]] = set()
        self._drained: asyncio.Future[None] | None = None
        self._closing = False
        self._prints: dict[int, tuple[ModelVersion, str]] = {}  # step -> (version, its print)
        # Tensors that more than one step reads, or that the ensemble answers: a step whose
        # code may write its inputs in place (Python, torch) gets its own copy of them.
        readers: dict[str, int] = {}
        for s in plan.steps:
            for tensor in s.inputs.values():
                readers[tensor] = readers.get(tensor, 0) + 1
        self._shared = {t for t, n in readers.items() if n > 1} | set(self._outputs)

    def cache_salt(self) -> str:
        """What the ensemble's answers depend on besides its inputs: each step's live
        version (name, version, config, files), for the response cache's key. The same in
        every worker that loaded the same files; a step reloaded with other ones changes it."""
        parts = []
        for step in self._plan.steps:
            try:
                mv = self._lookup(step.model, step.version)
            except RTServeError:
                return ""  # (the request fails when its step runs)
            memo = self._prints.get(step.index)
            if memo is None or memo[0] is not mv:
                memo = (mv, _version_print(mv))
                self._prints[step.index] = memo
            parts.append(memo[1])
        return ",".join(parts)

    @property
    def queue_depth(self) -> int:
        return len(self._tasks)

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    async def drain(self) -> None:
        while self._tasks:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    async def stop(self) -> None:
        self._closing = True
        await self.drain()

    def submit(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        timings: Timings,
        timeout_s: float = 0.0,
        priority: object = None,
        on_done: Callable[[asyncio.Future[Outputs]], object] | None = None,
    ) -> asyncio.Future[Outputs]:
        """``priority`` (the request parameter) goes to every step: each step's model reads
        it against its own priority levels, and a model without levels ignores it."""
        if self._closing:
            raise ShuttingDown(f"model '{self.name}' is shutting down")
        if len(self._tasks) >= self._max_in_flight:
            raise Overloaded(
                f"ensemble '{self.name}' has {self._max_in_flight} requests in flight "
                "(dynamic_batching.max_queue_size); retry later"
            )
        loop = asyncio.get_running_loop()
        timings.enqueued = _now()
        future: asyncio.Future[Outputs] = loop.create_future()
        task = loop.create_task(self._run(feeds, rows, timings, timeout_s, priority, future))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        if on_done is not None:
            future.add_done_callback(on_done)
        return future

    def refuse_early(self, received_ns: int) -> None:
        """An ensemble has no queue of its own: its steps' models decide admission."""
        return None

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not self._tasks and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def step_model(self, step: EnsembleStep) -> ModelVersion:
        """The step's live version, checked against the plan if it changed (a reload)."""
        try:
            mv = self._lookup(step.model, step.version)
        except RTServeError as exc:
            raise ModelNotReady(
                f"ensemble '{self.name}' {step.label} is not available: {exc.message}"
            ) from None
        if self._checked.get(step.index) is not mv:
            # A reload may change names, types, shapes or batching (a smaller
            # max_batch_size would never take the ensemble's batches): all checked again.
            try:
                models = {
                    s.index: mv if s.index == step.index else self._lookup(s.model, s.version)
                    for s in self._plan.steps
                }
                check_against_models(self._config, self._plan, models)
            except (ConfigError, RTServeError) as exc:
                why = str(exc).removeprefix(f"{self._config.source}: ")  # (no server paths)
                raise ModelNotReady(
                    f"ensemble '{self.name}' {step.label} no longer fits the ensemble: {why}"
                ) from None
            self._checked[step.index] = mv
        return mv

    def steps_ready(self) -> bool:
        for step in self._plan.steps:
            try:
                self._lookup(step.model, step.version)
            except RTServeError:
                return False
        return True

    async def _run(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        timings: Timings,
        timeout_s: float,
        priority: object,
        future: asyncio.Future[Outputs],
    ) -> None:
        start = _now()
        deadline = start + int(timeout_s * 1e9) if timeout_s > 0 else 0
        try:
            tensors = dict(feeds)
            first_batch = 0
            for level in self._plan.levels:
                remaining = 0.0
                if deadline:
                    remaining = (deadline - _now()) / 1e9
                    if remaining <= 0:
                        raise DeadlineExceeded(
                            f"ensemble '{self.name}': request timed out after "
                            f"{timeout_s * 1e3:.3g} ms (before {level[0].label})"
                        )
                if len(level) == 1:
                    results = [await self._step(level[0], tensors, rows, remaining, priority)]
                else:
                    gathered = await asyncio.gather(
                        *(self._step(s, tensors, rows, remaining, priority) for s in level),
                        return_exceptions=True,
                    )
                    failed = [r for r in gathered if isinstance(r, BaseException)]
                    if failed:
                        raise failed[0]
                    results = gathered  # type: ignore[assignment]
                for step, (outputs, step_timings) in zip(level, results, strict=True):
                    if not first_batch and step_timings.batch_start:
                        first_batch = step_timings.batch_start
                    for name, tensor in step.outputs.items():
                        tensors[tensor] = outputs[name]
            result = {name: tensors[name] for name in self._outputs}
            batched = self._config.max_batch_size > 0
            for spec in self._config.outputs or ():
                _check_shape(result[spec.name], spec, batched, self.name, "output", spec.name)
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        end = _now()
        timings.batch_start = first_batch or start
        timings.batch_end = end
        timings.batch_size = rows
        if self._on_done is not None:
            self._on_done(rows, end - start)
        if not future.done():
            future.set_result(result)

    async def _step(
        self,
        step: EnsembleStep,
        tensors: dict[str, np.ndarray],
        rows: int,
        timeout_s: float,
        priority: object,
    ) -> tuple[Outputs, Timings]:
        mv = self.step_model(step)
        t = Timings(received=_now())
        feeds = {name: tensors[tensor] for name, tensor in step.inputs.items()}
        if mv.platform not in _READ_ONLY_PLATFORMS:
            for name, tensor in step.inputs.items():
                if tensor in self._shared:
                    feeds[name] = feeds[name].copy()
        batched = self._config.max_batch_size > 0
        for name, tensor in step.inputs.items():  # (a producer's -1 dims are only known now)
            _check_shape(feeds[name], mv.inputs[name], batched, self.name, step.label, tensor)
        if mv.row_parameters:  # the request's value (checked by the ensemble), else the step's
            given = {}
            for p in mv.row_parameters:
                value = tensors.get(p.name)
                if value is not None and value.size and not math.isnan(value.flat[0]):
                    given[p.name] = float(value.flat[0])
            feeds = row_feeds(mv.row_parameters, given, feeds, rows)
        try:
            outputs = await mv.scheduler.submit(feeds, rows, t, timeout_s, priority)
        except BaseException as exc:
            if isinstance(exc, Exception):
                mv.metrics.observe_failure(outcome_of(exc), t, _now())
                raise _step_error(self.name, step, exc) from None
            raise
        mv.metrics.observe_success(t, rows, _now())
        return outputs, t


class EnsembleVersion(ModelVersion):
    """A ModelVersion that is ready only while the registry says so and every step is."""

    __slots__ = ("_own_ready",)

    @property  # type: ignore[override]
    def ready(self) -> bool:
        if not self._own_ready:
            return False
        scheduler = self.scheduler
        assert isinstance(scheduler, EnsembleScheduler)
        return scheduler.steps_ready()

    @ready.setter
    def ready(self, value: bool) -> None:
        self._own_ready = value


async def build_ensemble_version(
    config: ModelConfig, version_dir: Path, version: str, ctx: BuildContext
) -> ModelVersion:
    """Check the steps against the live models and build the ensemble's version."""
    plan = parse_steps(config)
    if ctx.lookup is None:
        raise ConfigError(f"{config.source}: steps: ensembles need a model registry")
    models: dict[int, ModelVersion] = {}
    for step in plan.steps:
        try:
            models[step.index] = ctx.lookup(step.model, step.version)
        except RTServeError as exc:
            field = "version" if step.version and "version" in exc.message else "model"
            raise ConfigError(
                f"{config.source}: {step.where}.{field}: {exc.message} (step models must "
                "be in the repository and load before the ensemble)"
            ) from None
    max_batch = check_against_models(config, plan, models)
    # A row parameter of any step (exit_threshold) is one of the ensemble's too: checked on
    # the request, passed to every step that takes it; absent (NaN): each step's default.
    forwarded: dict[str, RowParameter] = {}
    for mv in models.values():
        for p in mv.row_parameters:
            forwarded.setdefault(p.name, dataclasses.replace(p, default=math.nan))
    if max_batch != config.max_batch_size:
        config = dataclasses.replace(config, max_batch_size=max_batch)
    metrics = ctx.metrics.model(config.name, version)
    scheduler = EnsembleScheduler(config, plan, ctx.lookup, dict(models), metrics.observe_batch)
    metrics.track_queue_depth(lambda: scheduler.queue_depth)
    cache = ctx.cache_for(config, version, tuple(config.outputs or ()))
    if cache is not None:
        cache.salt = scheduler.cache_salt
    return EnsembleVersion(
        name=config.name,
        version=version,
        config=config,
        platform="ensemble",
        scheduler=scheduler,
        metrics=metrics,
        inputs={s.name: s for s in config.inputs or ()},
        outputs={s.name: s for s in config.outputs or ()},
        runtime=None,
        cache=cache,
        row_parameters=tuple(forwarded.values()),
    )
