"""Typed answers of the non-inference routes; each frontend encodes them its own way."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    datatype: str
    shape: tuple[int, ...]  # as clients see it: -1 first when the model batches


@dataclass(frozen=True, slots=True)
class ServerInfo:
    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The V2 model metadata."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]


@dataclass(frozen=True, slots=True)
class ConfigTensor:
    name: str
    data_type: str  # Triton's TYPE_* name
    dims: tuple[int, ...]  # per row when batching


@dataclass(frozen=True, slots=True)
class ModelConfigInfo:
    """The configuration in the shape of Triton's model-configuration extension."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: tuple[ConfigTensor, ...]
    outputs: tuple[ConfigTensor, ...]
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int
    instance_count: int
    priority_levels: int = 0  # 0: none; else request priority 1 (highest) .. N
    default_priority: int = 0
    # Triton's free-form ``parameters``: here the latency objective (``slo_p99_ms`` etc.).
    parameters: tuple[tuple[str, str], ...] = ()
