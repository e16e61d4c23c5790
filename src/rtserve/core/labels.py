"""Class labels per output, in index order, for the classification extension."""

from __future__ import annotations

from pathlib import Path

from rtserve.config import ModelConfig
from rtserve.errors import ConfigError
from rtserve.runtime.base import Runtime

MAX_LABELS_BYTES = 16 * 1024 * 1024


def read_labels(
    config: ModelConfig, model_dir: Path, runtime: Runtime
) -> dict[str, tuple[str, ...]]:
    """Each output's class labels: the runtime's own (a ZipMap's classes), then the config's
    ``labels`` files (one label per line, in index order), which take precedence."""
    labels: dict[str, tuple[str, ...]] = dict(getattr(runtime, "labels", None) or {})
    names = [s.name for s in runtime.outputs]
    root = model_dir.resolve()
    for output, file in config.labels.items():
        where = f"{config.source}: labels.{output}"
        if output not in names:
            raise ConfigError(f"{where}: the model has no output {output!r} ({', '.join(names)})")
        path = (model_dir / file).resolve()
        if not path.is_relative_to(root):
            raise ConfigError(f"{where}: {file!r} is outside the model's directory")
        try:
            if path.stat().st_size > MAX_LABELS_BYTES:
                raise ConfigError(f"{where}: {file} is larger than {MAX_LABELS_BYTES} bytes")
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: cannot read {file}: {exc}") from None
        labels[output] = tuple(text.splitlines())
    return labels
