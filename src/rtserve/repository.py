"""The model repository on disk: ``<repo>/<model>/config.yaml`` and
``<repo>/<model>/<version>/...``.

This module only reads the disk: it turns each model directory into a ``ModelSource``
(name, parsed config, the version directories its version policy selects, or the error
that stops it from loading). Building live models is ``core.model``'s job; keeping them is
``core.registry``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rtserve.config import ModelConfig, load_yaml, parse_model_config
from rtserve.errors import ConfigError


@dataclass(slots=True)
class ModelSource:
    """One model directory as found on disk."""

    name: str
    path: Path
    config: ModelConfig | None = None
    versions: dict[str, Path] = field(default_factory=dict)  # version -> its directory
    error: str = ""

    @property
    def latest(self) -> str:
        return max(self.versions, key=int) if self.versions else ""


def version_dirs(model_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def read_model(
    model_dir: Path, override: dict[str, object] | None = None, where: str = ""
) -> ModelSource:
    """Parse one model directory; a config or layout error is recorded, never raised.

    ``override``: a config mapping used instead of ``config.yaml`` (model control's load
    with a config in the request body); ``where``: what errors name as its origin."""
    name = model_dir.name
    source = ModelSource(name, model_dir)
    where = where or str(model_dir / "config.yaml")
    try:
        raw = override if override is not None else load_yaml(model_dir / "config.yaml")
        config = parse_model_config(raw, name, where)
        source.config = config
        versions = version_dirs(model_dir)
        if config.version_policy == "latest":
            versions = versions[-config.versions[0] :]
        elif config.version_policy == "specific":
            missing = set(config.versions) - set(versions)
            if missing:
                raise ConfigError(
                    f"{where}: version_policy.specific: versions {sorted(missing)} "
                    f"have no directory in {model_dir}"
                )
            versions = [v for v in versions if v in config.versions]
        if not versions:
            raise ConfigError(f"{model_dir}: no version directories (expected e.g. 1/model.onnx)")
        source.versions = {str(v): model_dir / str(v) for v in versions}
    except ConfigError as exc:
        source.error = str(exc)
    return source


def scan(root: Path) -> list[ModelSource]:
    """Every model directory under ``root`` (hidden ones skipped), in name order."""
    if not root.is_dir():
        raise ConfigError(f"{root}: model repository is not a directory")
    return [
        read_model(d)
        for d in sorted(p for p in root.iterdir() if p.is_dir())
        if not d.name.startswith(".")
    ]
