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
says why. With ``--workers N`` explicit requests are written to a shared journal that
every worker applies, so all workers converge; in poll mode every worker polls the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any

import grpc

from rtserve.core.registry import ModelRegistry
from rtserve.errors import ConfigError, InvalidInput, ModelNotFound, RTServeError
from rtserve.protocol.limits import shown
from rtserve.repository import ModelSource, read_model, scan

log = logging.getLogger(__name__)

MODES = ("none", "poll", "explicit")


class LoadFailed(RTServeError):
    """The model could not be loaded; the old versions (if any) keep serving."""

    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


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
        self.journal = journal  # shared by the workers of one server (explicit mode)
        self._seen = 0  # journal entries applied
        self._prints: dict[str, tuple[Any, ...]] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ start / stop
    async def start(self) -> None:
        if self.mode == "explicit":
            names = self.startup_models
            if "*" in names:
                names = tuple(s.name for s in scan(self.root))
            sources = [self._source(n) for n in names]
            await self.registry.load_all(sources)
            for s in sources:
                self._prints[s.name] = _fingerprint(s.path)
            if self.journal is not None:  # a worker (re)started late catches up
                await self._apply_journal()
        else:
            sources = scan(self.root)
            for s in sources:
                self._prints[s.name] = _fingerprint(s.path)
            await self.registry.load_all(sources)
        if self.mode == "poll" or (self.mode == "explicit" and self.journal is not None):
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ------------------------------------------------------------------ API
    async def load(self, name: str, config: dict[str, Any] | None = None) -> None:
        """Load (or reload) a model; raises ``LoadFailed`` naming the reason."""
        self._explicit_only("load")
        self._append_journal({"op": "load", "name": name, "config": config})
        await self._load(name, config)

    async def unload(self, name: str) -> None:
        self._explicit_only("unload")
        if name not in self.registry.models:
            raise ModelNotFound(f"unknown model '{shown(name)}' (not loaded)")
        self._append_journal({"op": "unload", "name": name})
        await self._unload(name)

    # ------------------------------------------------------------------ internals
    def _explicit_only(self, what: str) -> None:
        if self.mode != "explicit":
            raise InvalidInput(
                f"model {what} is not allowed in model control mode '{self.mode}' "
                "(start the server with --model-control-mode explicit)"
            )

    def _source(self, name: str, config: dict[str, Any] | None = None) -> ModelSource:
        if not name or "/" in name or name.startswith(".") or len(name) > 255:
            raise InvalidInput(f"model name '{shown(name)}': expected a directory name")
        path = self.root / name
        if not path.is_dir():
            raise ModelNotFound(f"unknown model '{shown(name)}': no such model in the repository")
        return read_model(path, config)

    async def _load(self, name: str, config: dict[str, Any] | None) -> None:
        async with self._lock:
            source = self._source(name, config)
            entry = await self.registry.load(source)
            self._prints[name] = _fingerprint(source.path)
        if entry.error:
            raise LoadFailed(f"failed to load '{name}': {entry.error}")

    async def _unload(self, name: str) -> None:
        async with self._lock:
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
                async with self._lock:
                    await self.registry.load(read_model(self.root / name))
                    self._prints[name] = fp
        for name in [n for n in list(self.registry.models) if n not in names]:
            log.info("model control: %s removed from disk; unloading", name)
            await self._unload(name)
            self.registry.unloaded.discard(name)  # gone from the repository: not listed

    # The journal: one JSON line per explicit request, shared by the workers.
    def _append_journal(self, entry: dict[str, Any]) -> None:
        if self.journal is None:
            return
        with open(self.journal, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(json.dumps({**entry, "pid": os.getpid()}) + "\n")
            fcntl.flock(f, fcntl.LOCK_UN)

    def _read_journal(self) -> list[dict[str, Any]]:
        assert self.journal is not None
        try:
            lines = self.journal.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    async def _apply_journal(self) -> None:
        entries = self._read_journal()
        for entry in entries[self._seen :]:
            self._seen += 1
            if entry.get("pid") == os.getpid():
                continue
            try:
                if entry["op"] == "load":
                    await self._load(entry["name"], entry.get("config"))
                else:
                    await self._unload(entry["name"])
            except RTServeError as exc:
                log.error("model control: %s of %s failed: %s", entry["op"], entry["name"], exc)
