"""Model control (Triton's model repository extension): load, unload, poll.

Modes (``--model-control-mode``):
- ``none``: every model in the repository loads at start; load/unload requests are refused.
- ``poll``: like ``none`` at start, then the repository is rescanned every
  ``--repository-poll-secs``: new or changed models (config or files) are (re)loaded,
  removed ones unloaded. Load/unload requests are refused (the disk is the truth).
- ``explicit``: only ``--load-model`` names load at start (``*`` = all); clients load and
  unload models through the API.

A (re)load is zero-downtime: the registry warms the new versions beside the old ones and
switches when they are ready; a failed load keeps the old versions serving and the index
says why. Loads and unloads of different models run side by side (one lock a model; a load
holds its ensemble steps' locks too), so a model whose load hangs holds up only itself.
A load request's config (``protocol/load_request.py``) is merged over the model's
config.yaml; an error it causes is the request's (400, nothing changes). Loading an ensemble
loads the models its steps call that are not loaded (as Triton does). With ``--workers N``
the loads and unloads that succeeded are recorded in a shared journal that every worker
applies, so all workers converge; in poll mode every worker polls the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import orjson

from rtserve.config import load_yaml
from rtserve.core.ensemble import cycle_error, step_models
from rtserve.core.registry import ModelRegistry
from rtserve.errors import ConfigError, InvalidInput, LoadFailed, ModelNotFound, RTServeError
from rtserve.protocol.limits import shown
from rtserve.protocol.load_request import WHERE, check_merged, merge
from rtserve.repository import ModelSource, read_model, scan

log = logging.getLogger(__name__)

MODES = ("none", "poll", "explicit")


def _fingerprint(path: Path) -> tuple[Any, ...]:
    """What changes when a model's config or files change (names, sizes, mtimes)."""
    items = []
    for p in sorted(path.rglob("*")):
        if "__pycache__" in p.parts:
            continue
        with contextlib.suppress(OSError):
            st = p.stat()
            items.append((str(p.relative_to(path)), st.st_size, st.st_mtime_ns))
    return tuple(items)


class Journal:
    """The explicit loads and unloads that succeeded, shared by the workers of one server.

    One JSON document holding the latest request per model, replaced whole under a lock: it
    grows with the models, not with the requests. Each entry carries a sequence number; a
    worker applies the entries of other workers it has not seen yet, oldest first, and reads
    the file again only when it changed (inode, size, modification time).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.applied = 0  # the highest sequence number seen
        self._stamp: tuple[int, int, int] | None = None

    def record(self, op: str, name: str, config: dict[str, Any] | None = None) -> None:
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
            doc = self._read()
            seq = doc["seq"] + 1
            entry = {"op": op, "config": config, "seq": seq, "pid": os.getpid()}
            doc = {"seq": seq, "models": {**doc["models"], name: entry}}
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(orjson.dumps(doc))
            os.replace(tmp, self.path)

    def _read(self) -> dict[str, Any]:
        try:
            doc = orjson.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {"seq": 0, "models": {}}
        assert isinstance(doc, dict)
        return doc

    def new_entries(self) -> list[tuple[str, dict[str, Any]]]:
        """(model, entry) recorded by other processes since the last call, oldest first."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return []
        self._stamp = stamp
        fresh = sorted(
            ((name, e) for name, e in self._read()["models"].items() if e["seq"] > self.applied),
            key=lambda item: int(item[1]["seq"]),
        )
        if fresh:
            self.applied = int(fresh[-1][1]["seq"])
        return [(name, e) for name, e in fresh if e["pid"] != os.getpid()]


class ModelControl:
    def __init__(
        self,
        registry: ModelRegistry,
        root: Path,
        mode: str = "none",
        poll_s: float = 15.0,
        startup_models: tuple[str, ...] = (),
        journal: Path | None = None,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(
                f"model_control_mode: expected one of {', '.join(MODES)}, got {mode!r}"
            )
        self.registry = registry
        self.root = root
        self.mode = mode
        self.poll_s = poll_s
        self.startup_models = startup_models
        # Shared by the workers of one server (explicit mode).
        self.journal = Journal(journal) if journal is not None else None
        self._prints: dict[str, tuple[Any, ...]] = {}
        # One lock a model name, with how many holders and waiters it has: dropped when
        # none is left (names come from clients; the dict stays as small as what is held).
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ start / stop
    async def start(self) -> None:
        if self.mode == "explicit":
            await self._start_explicit()
        else:
            sources = scan(self.root)
            for s in sources:
                self._prints[s.name] = _fingerprint(s.path)
            await self.registry.load_all(sources)
        if self.mode == "poll" or (self.mode == "explicit" and self.journal is not None):
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _start_explicit(self) -> None:
        """Load the ``--load-model`` names (with the steps of ensembles among them), then
        what the other workers loaded since they started."""
        names = self.startup_models
        if "*" in names:
            names = tuple(s.name for s in scan(self.root))
        sources = [self._source(n) for n in names]
        for source in sorted(sources, key=_is_ensemble):  # step models first
            async with self._holding(self._touched(source)):
                if self._serving(source.name):
                    continue  # loaded already as the step of an ensemble
                try:
                    await self._load_source(source)
                except RTServeError as exc:
                    log.error("model control: %s", exc)
                    if source.name not in self.registry.models:  # a step failed: listed too
                        await self.registry.load(source)
        if self.journal is not None:  # a worker (re)started late catches up
            await self._apply_journal()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ------------------------------------------------------------------ API
    async def load(self, name: str, config: dict[str, Any] | None = None) -> None:
        """Load (or reload) a model; ``config``: a checked load request config, merged over
        config.yaml. Raises ``LoadFailed`` (or ``InvalidInput``) naming the reason."""
        self._explicit_only("load")
        source = self._source(name, config)
        async with self._holding(self._touched(source)):
            await self._load_source(source)
            if self.journal is not None:
                self.journal.record("load", name, config)

    async def unload(self, name: str) -> None:
        self._explicit_only("unload")
        async with self._holding([name]):
            if name not in self.registry.models:
                raise ModelNotFound(f"unknown model '{shown(name)}' (not loaded)")
            await self._unload(name)
            if self.journal is not None:
                self.journal.record("unload", name)

    # ------------------------------------------------------------------ internals
    @contextlib.asynccontextmanager
    async def _holding(self, names: Iterable[str]) -> AsyncIterator[None]:
        """Hold the locks of ``names``, taken in sorted order (no two loads deadlock)."""
        names = sorted(set(names))
        locks = []
        for name in names:
            lock, users = self._locks.get(name) or (asyncio.Lock(), 0)
            self._locks[name] = (lock, users + 1)
            locks.append(lock)
        try:
            async with contextlib.AsyncExitStack() as stack:
                for lock in locks:
                    await stack.enter_async_context(lock)
                yield
        finally:
            for name in names:
                lock, users = self._locks[name]
                if users == 1:
                    del self._locks[name]
                else:
                    self._locks[name] = (lock, users - 1)

    def _touched(self, source: ModelSource, chain: tuple[str, ...] = ()) -> set[str]:
        """The models a load of ``source`` may (re)load: itself and, for an ensemble, the
        step models in the repository, their own steps too."""
        names = {source.name}
        if source.config is None or source.config.backend != "ensemble":
            return names
        for step in step_models(source.config):
            if step in names or step in chain or "/" in step or not (self.root / step).is_dir():
                continue
            try:
                names |= self._touched(self._source(step), (*chain, source.name))
            except RTServeError:
                names.add(step)
        return names

    def _explicit_only(self, what: str) -> None:
        if self.mode != "explicit":
            raise InvalidInput(
                f"model {what} is not allowed in model control mode '{self.mode}' "
                "(start the server with --model-control-mode explicit)"
            )

    def _model_dir(self, name: str) -> Path:
        if not name or "/" in name or name.startswith(".") or len(name) > 255:
            raise InvalidInput(f"model name '{shown(name)}': expected a directory name")
        path = self.root / name
        if not path.is_dir():
            raise ModelNotFound(f"unknown model '{shown(name)}': no such model in the repository")
        return path

    def _source(self, name: str, config: dict[str, Any] | None = None) -> ModelSource:
        path = self._model_dir(name)
        return read_model(path) if not config else self._merged_source(path, config)

    def _merged_source(self, path: Path, body: dict[str, Any]) -> ModelSource:
        """config.yaml with the request's config merged over it. An error of the file alone
        is the file's (reported as a load without a body); any other is the request's:
        InvalidInput, and nothing is loaded."""
        try:
            raw = load_yaml(path / "config.yaml")
        except ConfigError:
            return read_model(path)
        on_disk = read_model(path, raw)
        if on_disk.error:
            return on_disk
        source = read_model(path, merge(raw, body), WHERE)
        if source.error or source.config is None:  # "<WHERE>: field: ..." -> "<WHERE>.field: ..."
            message = self.registry.redact(source.error).replace(f"{WHERE}: ", f"{WHERE}.", 1)
            raise InvalidInput(message)
        check_merged(source.config, body)
        return source

    def _serving(self, name: str) -> bool:
        entry = self.registry.models.get(name)
        return entry is not None and bool(entry.versions)

    async def _load_source(self, source: ModelSource) -> None:
        """Load the models an ensemble's steps call, then the source (their locks are held)."""
        await self._load_steps(source, [source.name])
        entry = await self.registry.load(source)
        self._prints[source.name] = _fingerprint(source.path)
        if entry.error:
            raise LoadFailed(f"failed to load '{source.name}': {entry.error}")

    async def _load_steps(self, source: ModelSource, chain: list[str]) -> None:
        """Load from the repository the step models of an ensemble that serve nothing yet,
        their own steps first; ``chain``: the ensembles being loaded, outermost first."""
        if source.config is None or source.config.backend != "ensemble":
            return
        for step in step_models(source.config):
            if self._serving(step) or "/" in step or not (self.root / step).is_dir():
                continue  # a step that is not in the repository: the ensemble's build names it
            if step in chain:
                error = cycle_error(source.config.source, [*chain, step])
                raise LoadFailed(f"failed to load '{chain[0]}': {self.registry.redact(str(error))}")
            step_source = self._source(step)
            await self._load_steps(step_source, [*chain, step])
            entry = await self.registry.load(step_source)
            self._prints[step] = _fingerprint(step_source.path)
            if entry.error:
                raise LoadFailed(
                    f"failed to load '{chain[0]}': its step model '{step}' did not load: "
                    f"{entry.error}"
                )

    async def _unload(self, name: str) -> None:
        """Unload (its lock is held)."""
        if name in self.registry.models:
            await self.registry.unload(name)
        self._prints.pop(name, None)

    async def _watch(self) -> None:
        period = self.poll_s if self.mode == "poll" else 0.2
        while True:
            await asyncio.sleep(period)
            try:
                if self.mode == "poll":
                    await self._poll()
                else:
                    await self._apply_journal()
            except Exception:
                log.exception("model control: checking the repository failed")

    async def _poll(self) -> None:
        names = {p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")}
        for name in sorted(names):
            fp = _fingerprint(self.root / name)
            if self._prints.get(name) != fp:
                log.info("model control: %s changed on disk; loading", name)
                async with self._holding([name]):
                    await self.registry.load(read_model(self.root / name))
                    self._prints[name] = fp
        for name in [n for n in list(self.registry.models) if n not in names]:
            log.info("model control: %s removed from disk; unloading", name)
            async with self._holding([name]):
                await self._unload(name)
            self.registry.unloaded.discard(name)  # gone from the repository: not listed

    async def _apply_journal(self) -> None:
        """Apply what the other workers loaded and unloaded."""
        assert self.journal is not None
        for name, entry in self.journal.new_entries():
            try:
                if entry["op"] == "load":
                    source = self._source(name, entry.get("config"))
                    async with self._holding(self._touched(source)):
                        await self._load_source(source)
                else:
                    async with self._holding([name]):
                        await self._unload(name)
            except RTServeError as exc:
                log.error("model control: %s of %s failed: %s", entry["op"], name, exc)


def _is_ensemble(source: ModelSource) -> bool:
    return source.config is not None and source.config.backend == "ensemble"
