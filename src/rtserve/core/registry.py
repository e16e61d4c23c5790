"""The live model versions: lookup, readiness, the repository index, load and unload.

Loading a model builds and warms every selected version beside whatever is serving now;
traffic moves to the new versions only when all of them are ready, then the old ones drain
and stop. A model that fails to load keeps its old versions serving and reports why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from rtserve.config import ModelConfig
from rtserve.core.ensemble import cycle_error, find_cycle, step_models
from rtserve.core.factory import build_version
from rtserve.core.model import BuildContext, ModelVersion
from rtserve.errors import ConfigError, ModelNotFound, ModelNotReady
from rtserve.protocol.limits import shown
from rtserve.repository import ModelSource

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelEntry:
    name: str
    versions: dict[str, ModelVersion] = field(default_factory=dict)
    latest: str = ""
    error: str = ""  # why the last load failed ("" if it did not)
    source: ModelSource | None = None
    loading: bool = False  # its versions are being built


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One row of the repository index (Triton's model repository extension)."""

    name: str
    version: str
    state: str  # READY | UNAVAILABLE | LOADING | UNLOADING
    reason: str = ""


class ModelRegistry:
    def __init__(self, ctx: BuildContext, root: Path | None = None) -> None:
        """``root``: the repository directory; error reasons that clients can read name
        paths relative to it (never the server's absolute paths)."""
        self.ctx = ctx
        self.root = root
        self._roots = [f"{r}/" for r in {str(root), str(root.resolve())}] if root else []
        ctx.lookup = self.get
        self.models: dict[str, ModelEntry] = {}
        # Models unloaded since they last loaded: listed in the index as UNAVAILABLE with
        # the reason "unloaded", as Triton lists them (a client polling the index sees the
        # unload instead of the model vanishing).
        self.unloaded: set[str] = set()

    # ------------------------------------------------------------------ loading
    async def load_all(self, sources: list[ModelSource]) -> None:
        """Load every source; ensembles last, once the models they call are live."""
        plain = [s for s in sources if s.config is None or s.config.backend != "ensemble"]
        for source in plain + [s for s in sources if s not in plain]:
            await self.load(source)

    async def load(self, source: ModelSource) -> ModelEntry:
        """Build the source's versions beside the serving ones, then switch over."""
        self.unloaded.discard(source.name)
        entry = self.models.get(source.name)
        if entry is None:
            entry = self.models[source.name] = ModelEntry(source.name)
        if source.error or source.config is None:
            entry.error = self.redact(source.error or f"model '{source.name}': no config")
            log.error("model %s not loaded: %s", source.name, entry.error)
            return entry
        built: dict[str, ModelVersion] = {}
        entry.loading = True
        try:
            self._check_cycle(source.config)
            for version, path in source.versions.items():
                built[version] = await build_version(source.config, path, version, self.ctx)
        except ConfigError as exc:
            for mv in built.values():
                await mv.stop()
            entry.error = self.redact(str(exc))
            log.error("model %s not loaded: %s", source.name, exc)
            return entry
        finally:
            entry.loading = False
        old = entry.versions
        for mv in built.values():
            mv.ready = True
        entry.versions, entry.latest, entry.error, entry.source = (
            built,
            source.latest,
            "",
            source,
        )
        log.info("model %s ready (versions %s)", source.name, ", ".join(built))
        for mv in old.values():
            await mv.stop()  # drains: requests it admitted are answered
        return entry

    def _check_cycle(self, config: ModelConfig) -> None:
        """Refuse an ensemble that would call itself through the live ensembles (its
        readiness and requests would recurse without end)."""
        if config.backend != "ensemble":
            return

        def calls(name: str) -> list[str]:
            if name == config.name:
                return step_models(config)
            entry = self.models.get(name)
            mv = entry.versions.get(entry.latest) if entry is not None else None
            return step_models(mv.config) if mv is not None else []

        chain = find_cycle(config.name, calls)
        if chain:
            raise cycle_error(config.source, chain)

    def redact(self, message: str) -> str:
        for root in self._roots:
            message = message.replace(root, "")
        return message

    async def unload(self, name: str) -> None:
        """Stop routing to the model, answer what it admitted, then release it."""
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(f"unknown model '{shown(name)}'")
        del self.models[name]
        self.unloaded.add(name)
        for mv in entry.versions.values():
            mv.ready = False
        for mv in entry.versions.values():
            await mv.stop()
        log.info("model %s unloaded", name)

    # ------------------------------------------------------------------ lookup
    def get(self, name: str, version: str = "") -> ModelVersion:
        """The version to serve a request (it must be ready)."""
        mv = self.get_loaded(name, version)
        if not mv.ready:
            raise ModelNotReady(f"model '{mv.name}' version {mv.version} is not ready")
        return mv

    def get_loaded(self, name: str, version: str = "") -> ModelVersion:
        """Like ``get`` but also returns versions that are not ready (metadata, readiness)."""
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(f"unknown model '{shown(name)}'")
        if not entry.versions:
            why = entry.error or ("it is loading" if entry.loading else "no version is loaded")
            raise ModelNotReady(f"model '{name}' is not available: {why}")
        mv = entry.versions.get(version or entry.latest)
        if mv is None and version.isdigit() and version.isascii():
            mv = entry.versions.get(str(int(version)))  # "01" is version 1, as Triton reads it
        if mv is None:
            raise ModelNotFound(
                f"unknown version '{shown(version)}' of model '{name}' "
                f"(available: {', '.join(entry.versions)})"
            )
        return mv

    def entry(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(f"unknown model '{shown(name)}'")
        return entry

    def loaded_versions(self) -> list[ModelVersion]:
        return [v for m in self.models.values() for v in m.versions.values()]

    def index(self) -> list[IndexEntry]:
        rows: list[IndexEntry] = []
        for entry in self.models.values():
            if entry.loading and not entry.versions:
                rows.append(IndexEntry(entry.name, "", "LOADING"))
            elif entry.error:
                rows.append(IndexEntry(entry.name, "", "UNAVAILABLE", entry.error))
            gone = self._unloaded_steps(entry)
            for v in entry.versions.values():
                reason = "" if v.ready or not gone else f"step model '{gone}' was unloaded"
                rows.append(
                    IndexEntry(entry.name, v.version, "READY" if v.ready else "UNAVAILABLE", reason)
                )
        rows.extend(
            IndexEntry(name, "", "UNAVAILABLE", "unloaded") for name in sorted(self.unloaded)
        )
        rows.extend(
            IndexEntry(name, "", "UNAVAILABLE", "not loaded")
            for name in self._repository_names()
            if name not in self.models and name not in self.unloaded
        )
        return rows

    def _repository_names(self) -> list[str]:
        """Every model directory of the repository (the index lists those never loaded,
        as Triton does in explicit mode)."""
        if self.root is None:
            return []
        try:
            return sorted(
                p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
            )
        except OSError:
            return []

    def failed(self) -> dict[str, str]:
        """Models asked for that serve no ready version -> why (strict readiness counts
        these; a failed reload whose old versions still serve is not one of them)."""
        return {
            name: entry.error or "not ready"
            for name, entry in self.models.items()
            if not any(mv.ready for mv in entry.versions.values())
            and not entry.loading  # (a first load in progress is not a failure)
            and not self._unloaded_steps(entry)  # (its step was unloaded on purpose)
        }

    def _unloaded_steps(self, entry: ModelEntry) -> str:
        """An ensemble's step model that was unloaded on purpose ("" if none)."""
        source = entry.source
        if source is None or source.config is None or source.config.backend != "ensemble":
            return ""
        return next((m for m in step_models(source.config) if m in self.unloaded), "")

    def set_ready(self, ready: bool) -> None:
        for mv in self.loaded_versions():
            mv.ready = ready

    async def stop(self) -> None:
        for mv in self.loaded_versions():
            await mv.stop()
