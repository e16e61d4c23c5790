"""Typed, validated model and server configuration.

Config is data (YAML). Every error names the file and the field, e.g.
``models/mlp/config.yaml: dynamic_batching.max_queue_size: expected an integer >= 1, got 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rtserve.backends import BACKENDS, backend_of
from rtserve.errors import ConfigError
from rtserve.protocol.limits import shown
from rtserve.protocol.types import DATATYPE_TO_NUMPY

if TYPE_CHECKING:
    from rtserve.runtime.pooling import EmbeddingSection


def shown_value(value: Any) -> str:
    """``repr`` of a config value for an error message, cut to 100 characters: a value
    sent in a load request must not be echoed whole into answers, the index and the log."""
    try:
        return shown(repr(value))
    except ValueError:  # an integer beyond Python's 4300-digit str limit
        return "a larger integer"


class _Fields:
    """Reads typed fields out of one mapping, collecting the names it has seen."""

    def __init__(self, data: Any, where: str, prefix: str = "") -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"{where}: {prefix or 'config'}: expected a mapping, got {shown_value(data)}"
            )
        self.data: dict[str, Any] = data
        self.where = where
        self.prefix = prefix
        self.seen: set[str] = set()

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str, expected: str, value: Any) -> ConfigError:
        return ConfigError(
            f"{self.where}: {shown(self.path(key))}: expected {expected}, got {shown_value(value)}"
        )

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return self.data.get(key, default)

    # Upper bounds by field path; any other integer field is bounded by INT32_MAX.
    _MAXIMA = {
        "max_batch_size": 1 << 20,
        "instance_count": 1024,
        "dynamic_batching.max_queue_delay_us": 60_000_000,
        "dynamic_batching.max_queue_size": 1 << 24,
        "dynamic_batching.default_timeout_us": 3_600_000_000,
        "onnxruntime.intra_op_threads": 1024,
        "onnxruntime.inter_op_threads": 1024,
        "warmup.iterations": 10_000,
        "http_port": 65535,
        "grpc_port": 65535,
        "max_request_bytes": 1 << 34,
        "priority_levels": 1024,  # one queue per level, scanned per batch
    }

    def integer(self, key: str, default: int, minimum: int = 0, maximum: int | None = None) -> int:
        value = self.get(key, default)
        if maximum is None:
            maximum = self._MAXIMA.get(self.path(key), 2**31 - 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, f"an integer >= {minimum}", value)
        if value > maximum:
            raise self.fail(key, f"an integer <= {maximum}", value)
        return value

    def number(
        self,
        key: str,
        default: float,
        minimum: float = 0.0,
        maximum: float | None = None,
        meaning: str = "",
    ) -> float:
        value = self.get(key, default)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 1e300:
            value = float("inf") if value > 0 else float("-inf")  # (float() would overflow)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)  # YAML .nan / .inf
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            about = f" ({meaning})" if meaning else ""
            if maximum is None:
                raise self.fail(key, f"a number >= {minimum}{about}", self.get(key, default))
            raise self.fail(
                key, f"a number from {minimum:g} to {maximum:g}{about}", self.get(key, default)
            )
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, "true or false", value)
        return value

    def string(self, key: str, default: str, choices: tuple[str, ...] | None = None) -> str:
        value = self.get(key, default)
        if not isinstance(value, str) or (choices and value not in choices):
            expected = f"one of {', '.join(choices)}" if choices else "a string"
            raise self.fail(key, expected, value)
        return value

    def int_list(self, key: str, minimum: int = 1) -> list[int]:
        value = self.get(key, [])
        if not isinstance(value, list) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in value
        ):
            raise self.fail(key, f"a list of integers >= {minimum}", value)
        return list(value)

    def sub(self, key: str) -> _Fields:
        return _Fields(self.get(key), self.where, self.path(key))

    def check_unknown(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            known = ", ".join(sorted(self.seen))
            raise ConfigError(
                f"{self.where}: {shown(self.path(str(unknown[0])))}: unknown field "
                f"(known fields: {known})"
            )


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output. ``shape`` is per row (no batch dimension) when batching."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DynamicBatching:
    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 1024
    default_timeout_us: int = 0  # 0: no server-side timeout unless the request sets one
    # Skip the wait when it cannot help (no idle client, or arrivals slower than a batch).
    adaptive_delay: bool = True


@dataclass(frozen=True, slots=True)
class OrtOptions:
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    graph_optimization_level: str = "all"
    execution_providers: tuple[str, ...] = ("CUDA", "CPU")
    # "auto" decides from the measured batch time whether to run on the event loop thread
    # (tiny models: a thread hop costs more than the compute) or on executor threads.
    execution: str = "auto"


@dataclass(frozen=True, slots=True)
class Warmup:
    batch_sizes: tuple[int, ...] = (1,)
    iterations: int = 2


@dataclass(frozen=True, slots=True)
class SLO:
    """A latency objective: the SLO controller replaces the fixed gathering window."""

    p99_ms: float
    p50_ms: float = 0.0  # 0: not set


AUTO_BATCH = -1
DEFAULT_MAX_BATCH = 32


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    backend: str = "onnxruntime"
    max_batch_size: int = AUTO_BATCH  # AUTO_BATCH: decided from the model's first dimensions
    inputs: tuple[TensorSpec, ...] | None = None
    outputs: tuple[TensorSpec, ...] | None = None
    dynamic_batching: DynamicBatching = field(default_factory=DynamicBatching)
    instance_count: int = 1
    onnxruntime: OrtOptions = field(default_factory=OrtOptions)
    warmup: Warmup = field(default_factory=Warmup)
    version_policy: str = "all"  # all | latest | specific
    # version_policy specific: those versions; latest: (n,), the n highest (default 1)
    versions: tuple[int, ...] = ()
    response_cache: dict[str, Any] | bool | None = None  # parsed by rtserve.cache.CacheConfig
    slo: SLO | None = None
    priority_levels: int = 0  # 0: no priorities; else request priority 1 (highest) .. N
    default_priority: int = 0  # priority of requests that set none (0: the lowest level)
    # The section named after a non-ONNX backend (``python:``, ``torch:``), validated by
    # that backend's module; ``steps`` of an ensemble, validated by the ensemble runtime.
    backend_options: dict[str, Any] = field(default_factory=dict)
    steps: tuple[Any, ...] = ()
    source: str = ""
    # A policy of ``core.policies.POLICIES`` by name ("": chosen from the sections set).
    scheduling_policy: str = ""
    # Output name -> a text file of its class labels (one per line, relative to the model's
    # directory), for the classification extension (Triton's label_filename).
    labels: dict[str, str] = field(default_factory=dict)
    # How an encoder's token states become ``/v1/embeddings`` vectors (runtime.pooling).
    embedding: EmbeddingSection | None = None


_LEVELS = ("disable", "basic", "extended", "layout", "all")
_PROVIDERS = ("CPU", "CUDA", "TensorRT")


def _tensor_specs(value: Any, where: str, key: str) -> tuple[TensorSpec, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f"{where}: {key}: expected a non-empty list of tensors, got {shown_value(value)}"
        )
    specs = []
    for i, item in enumerate(value):
        f = _Fields(item, where, f"{key}[{i}]")
        name = f.string("name", "")
        if not name:
            raise f.fail("name", "a non-empty string", name)
        datatype = f.string("datatype", "", tuple(DATATYPE_TO_NUMPY))
        shape = f.get("shape")
        if not isinstance(shape, list) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < -1 for d in shape
        ):
            raise f.fail("shape", "a list of dimensions (integers >= -1; -1 = any)", shape)
        f.check_unknown()
        specs.append(TensorSpec(name, datatype, tuple(shape)))
    return tuple(specs)


VERSION_POLICIES = (
    "all, latest, {latest: {num_versions: N}}, {specific: [versions]} or "
    "{specific: {versions: [...]}}"
)


def version_policy(value: Any) -> tuple[str, tuple[int, ...]]:
    """(policy, versions) of a ``version_policy`` value, ours or Triton's form
    (``{latest: {num_versions: 2}}``, ``{specific: {versions: [1]}}``, ``{all: {}}``);
    raises ValueError saying what was expected."""
    if value in ("all", "latest"):
        return str(value), (1,) if value == "latest" else ()
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(VERSION_POLICIES)
    ((kind, arg),) = value.items()
    if kind == "all" and arg in ({}, None):
        return "all", ()
    if kind == "latest" and (
        arg in ({}, None) or isinstance(arg, dict) and set(arg) <= {"num_versions"}
    ):
        n = (arg or {}).get("num_versions", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1 << 20:
            raise ValueError("latest.num_versions: an integer >= 1")
        return "latest", (n,)
    if kind == "specific":
        if isinstance(arg, dict) and set(arg) == {"versions"}:
            arg = arg["versions"]
        if (
            not isinstance(arg, list)
            or not arg
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in arg)
        ):
            raise ValueError("specific: a non-empty list of version numbers >= 1")
        return "specific", tuple(arg)
    raise ValueError(VERSION_POLICIES)


def parse_model_config(data: Any, name: str, where: str) -> ModelConfig:
    f = _Fields(data, where)
    cfg_name = f.string("name", name)
    if cfg_name != name:
        raise f.fail("name", f"the directory name {name!r}", cfg_name)
    backend = f.string("backend", "onnxruntime")  # rtserve.backends.BACKENDS names them
    max_batch_size = f.integer("max_batch_size", 0) if "max_batch_size" in f.data else AUTO_BATCH
    f.seen.add("max_batch_size")
    inputs = _tensor_specs(f.get("inputs"), where, "inputs")
    outputs = _tensor_specs(f.get("outputs"), where, "outputs")
    batching = _batching_section(f.sub("dynamic_batching"), max_batch_size)
    ort_options = _ort_section(f.sub("onnxruntime"))
    warmup = _warmup_section(f.sub("warmup"), max_batch_size)
    policy_value = f.get("version_policy", "all")
    try:
        policy, versions = version_policy(policy_value)
    except ValueError as exc:
        raise f.fail("version_policy", str(exc), policy_value) from None
    cache = _cache_section(f)
    instance_count = f.integer("instance_count", 1, minimum=1)
    scheduling_policy = f.string("scheduling_policy", "")  # (checked by core.policies)
    slo, priority_levels, default_priority, options = _scheduling_and_backend(f, backend)
    labels = _labels_section(f)
    steps = _steps_section(f, backend)
    embedding = None
    if f.get("embedding") is not None:
        from rtserve.runtime.pooling import parse_section  # (pure, as the cache section's)

        embedding = parse_section(f.sub("embedding"))
    other = [b for b, spec in BACKENDS.items() if spec.section and b != backend and b in f.data]
    if other:  # (the section of another backend: say so, not just "unknown field")
        raise ConfigError(
            f"{where}: {other[0]}: options of backend {other[0]}, but the backend is "
            f"{backend} (set backend: {other[0]}, or remove the section)"
        )
    f.check_unknown()
    return ModelConfig(
        name=name,
        backend=backend,
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=outputs,
        dynamic_batching=batching,
        instance_count=instance_count,
        onnxruntime=ort_options,
        warmup=warmup,
        version_policy=policy,
        versions=versions,
        response_cache=cache,
        slo=slo,
        priority_levels=priority_levels,
        default_priority=default_priority,
        backend_options=options,
        steps=steps,
        source=where,
        labels=labels,
        scheduling_policy=scheduling_policy,
        embedding=embedding,
    )


def _batching_section(db: _Fields, max_batch_size: int) -> DynamicBatching:
    preferred = db.int_list("preferred_batch_sizes")
    if max_batch_size > 0 and any(p > max_batch_size for p in preferred):
        raise db.fail(
            "preferred_batch_sizes", f"sizes <= max_batch_size ({max_batch_size})", preferred
        )
    batching = DynamicBatching(
        max_queue_delay_us=db.integer("max_queue_delay_us", 0),
        preferred_batch_sizes=tuple(sorted(preferred)),
        max_queue_size=db.integer("max_queue_size", 1024, minimum=1),
        default_timeout_us=db.integer("default_timeout_us", 0),
        adaptive_delay=db.boolean("adaptive_delay", True),
    )
    db.check_unknown()
    return batching


def _ort_section(ort: _Fields) -> OrtOptions:
    providers = ort.get("execution_providers", ["CUDA", "CPU"])
    if not isinstance(providers, list) or any(p not in _PROVIDERS for p in providers):
        raise ort.fail(
            "execution_providers", f"a list drawn from {', '.join(_PROVIDERS)}", providers
        )
    options = OrtOptions(
        intra_op_threads=ort.integer("intra_op_threads", 1),
        inter_op_threads=ort.integer("inter_op_threads", 1),
        graph_optimization_level=ort.string("graph_optimization_level", "all", _LEVELS),
        execution_providers=tuple(providers),
        execution=ort.string("execution", "auto", ("auto", "inline", "thread")),
    )
    ort.check_unknown()
    return options


def _warmup_section(wu: _Fields, max_batch_size: int) -> Warmup:
    warmup = Warmup(
        batch_sizes=tuple(wu.int_list("batch_sizes") or [1]),
        iterations=wu.integer("iterations", 2),
    )
    if max_batch_size > 0 and any(b > max_batch_size for b in warmup.batch_sizes):
        raise wu.fail(
            "batch_sizes", f"sizes <= max_batch_size ({max_batch_size})", warmup.batch_sizes
        )
    wu.check_unknown()
    return warmup


def _cache_section(f: _Fields) -> dict[str, Any] | bool | None:
    cache = f.get("response_cache")
    if cache is not None and not isinstance(cache, dict | bool):
        raise f.fail("response_cache", "a mapping (or false)", cache)
    if isinstance(cache, dict):  # checked now, not after the model loaded and warmed up
        from rtserve.cache.config import CacheConfig

        CacheConfig.from_dict(cache, f.where)
    return cache


def _scheduling_and_backend(
    f: _Fields, backend: str
) -> tuple[SLO | None, int, int, dict[str, Any]]:
    """The latency objective and priority levels, and the backend's own section
    (``<backend>:``, validated by the backend when it loads), as its line in
    ``rtserve.backends.BACKENDS`` says."""
    spec = backend_of(backend)
    if spec.objectives == "none":
        # An ensemble has no queue of its own: objectives and levels live on its step models.
        for key, what in (
            ("slo", "no latency objective"),
            ("priority_levels", "no priority_levels"),
            ("default_priority", "no default_priority"),
        ):
            value = f.get(key)
            if value is not None:
                raise f.fail(key, f"{what} on an ensemble (set {key} on its step models)", value)
    token_slo = None
    if spec.objectives == "tokens":  # (ttft/itl for llm, validated by runtime.llm.options)
        slo, priority_levels, default_priority = None, 0, 0
        token_slo = f.get("slo")
    else:
        slo, priority_levels, default_priority = _slo_section(f)
    options: dict[str, Any] = {}
    if spec.section:
        section = f.get(backend, {})
        if not isinstance(section, dict):
            raise f.fail(backend, "a mapping of backend options", section)
        options = dict(section)
        if token_slo is not None:
            options["slo"] = token_slo
    return slo, priority_levels, default_priority, options


def _labels_section(f: _Fields) -> dict[str, str]:
    labels = f.get("labels", {})
    if not isinstance(labels, dict) or any(
        not isinstance(k, str) or not isinstance(v, str) or not v or Path(v).is_absolute()
        for k, v in labels.items()
    ):
        raise f.fail(
            "labels",
            "a mapping of output name to a labels file in the model's directory "
            "(one label per line)",
            labels,
        )
    return dict(labels)


def _steps_section(f: _Fields, backend: str) -> tuple[Any, ...]:
    steps = f.get("steps")
    if steps is not None and backend != "ensemble":
        raise f.fail("steps", "no steps unless backend is ensemble", steps)
    if backend == "ensemble" and (not isinstance(steps, list) or not steps):
        raise f.fail("steps", "a non-empty list of steps (backend ensemble)", steps)
    return tuple(steps or ())


def _slo_section(f: _Fields) -> tuple[SLO | None, int, int]:
    slo = None
    if f.get("slo") is not None:
        sf = f.sub("slo")
        p99 = sf.number("p99_ms", 0.0)
        if p99 <= 0:
            raise sf.fail("p99_ms", "a latency objective in milliseconds > 0", sf.get("p99_ms"))
        p50 = sf.number("p50_ms", 0.0)
        if p50 > p99:
            raise sf.fail("p50_ms", f"a number <= p99_ms ({p99:g})", p50)
        sf.check_unknown()
        slo = SLO(p99_ms=p99, p50_ms=p50)
    levels = f.integer("priority_levels", 0)
    if levels and slo is None:
        # Priorities are scheduled by the latency objective; a fixed window would ignore them.
        raise f.fail("priority_levels", "no priority_levels unless slo is set", levels)
    default = f.integer("default_priority", levels)
    if levels == 0 and default != 0:
        raise f.fail(
            "default_priority", "no default_priority unless priority_levels is set", default
        )
    if levels and not 1 <= default <= levels:
        raise f.fail("default_priority", f"a level from 1 (highest) to {levels}", default)
    return slo, levels, default


MAX_CONFIG_BYTES = 1 << 20


class _NoAliasLoader(yaml.SafeLoader):
    """Safe YAML without aliases: ``*name`` could expand a small file into gigabytes."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                "aliases (*name) are not allowed in rtserve config files",
                event.start_mark,
            )
        return super().compose_node(parent, index)


def load_yaml(path: Path) -> Any:
    """Parse a config file: at most MAX_CONFIG_BYTES, safe YAML without aliases."""
    if not path.exists():
        return {}
    with path.open("rb") as fh:
        raw = fh.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return yaml.load(raw, Loader=_NoAliasLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc)[:500]}") from None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    grpc_server: str = "rtserve"  # rtserve (own HTTP/2 framing) | grpcio (grpc.aio servers)
    max_request_bytes: int = 64 * 1024 * 1024
    grace_period_s: float = 30.0
    response_cache: dict[str, Any] | bool | None = None  # server-wide default for every model
    config_file: str = ""
    log_level: str = "info"
    # HTTP/1.1 transport limits (rtserve.server.http1.HttpLimits), named in refusals.
    http_max_url_bytes: int = 8 * 1024
    http_max_headers: int = 100
    http_max_header_bytes: int = 16 * 1024
    http_max_head_bytes: int = 64 * 1024
    http_idle_timeout_s: float = 75.0
    http_header_timeout_s: float = 20.0
    http_body_timeout_s: float = 30.0
    http_max_connections: int = 10_000
    # Model control (rtserve.core.control): none | poll | explicit.
    model_control_mode: str = "none"
    repository_poll_secs: float = 15.0
    load_models: tuple[str, ...] = ()
    # Observability: log format (text | json), access log, OpenTelemetry export.
    log_format: str = "text"
    access_log: bool = False
    trace_endpoint: str = ""  # OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces
    trace_sample_ratio: float = 1.0
    # Decoding budget per request (rtserve.protocol.limits.DecodeLimits; tightened per model
    # to what its signature accepts) and the largest decompressed body.
    max_tensor_elements: int = 1 << 24
    max_bytes_elements: int = 1 << 16
    max_json_depth: int = 32
    max_json_containers: int = 1 << 16
    max_decompressed_bytes: int = 64 * 1024 * 1024
    # Security (rtserve.server.security): auth keys file, per-client rate limit, TLS.
    auth_file: str = ""
    rate_limit_rps: float = 0.0  # 0: no limit
    rate_limit_burst: int = 0  # 0: 2 x the rate
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # set: clients must present a certificate it signed (mTLS)
    # Readiness: not ready until every model asked for serves (strict); or stop at start
    # with a non-zero exit when one fails to load (exit_on_error).
    strict_readiness: bool = True
    exit_on_error: bool = False
    # Triton's system shared memory extension (rtserve.protocol.shared_memory): "none" (off)
    # or "system" (clients may register files in /dev/shm); at most this many regions.
    shared_memory: str = "none"
    shared_memory_max_regions: int = 64
    # Set by ``--workers N`` for its workers: a directory they share (model control journal,
    # metrics snapshots) and each worker's index. Not a user setting.
    shared_dir: str = ""
    worker_index: int = 0


# Set by the server for its own processes (``--workers``), not read from a file.
_INTERNAL_SETTINGS = ("shared_dir", "worker_index")


def load_server_config(path: Path | None, **overrides: Any) -> ServerConfig:
    """Server settings: the YAML file (optional), then the overrides that are set (command
    line, ``Engine.from_repository``, adapters); every value checked the same way."""
    raw: Any = {}
    where = "server settings"
    if path is not None:
        if not path.exists():
            raise ConfigError(f"{path}: server config file not found")
        raw = load_yaml(path)
        where = str(path)
    internal = {k: overrides.pop(k) for k in _INTERNAL_SETTINGS if k in overrides}
    set_here = {k: v for k, v in overrides.items() if v is not None}
    if set_here and isinstance(raw, dict):
        raw = {**raw, **set_here}
        if path is not None:
            where = f"{path} (with the settings given)"
    elif set_here and raw is None:
        raw = set_here
    f = _Fields(raw, where)
    data = {
        "config_file": str(path) if path is not None else "",
        "model_repository": f.get("model_repository"),
        "host": f.string("host", "127.0.0.1"),
        "http_port": f.integer("http_port", 8000),
        "grpc_port": f.integer("grpc_port", 8001),
        "grpc_server": f.string("grpc_server", "rtserve", ("rtserve", "grpcio")),
        "max_request_bytes": f.integer("max_request_bytes", 64 * 1024 * 1024, minimum=1),
        "grace_period_s": f.number("grace_period_s", 30.0),
        "response_cache": f.get("response_cache"),
        "log_level": f.string("log_level", "info"),
        "http_max_url_bytes": f.integer("http_max_url_bytes", 8 * 1024, minimum=1),
        "http_max_headers": f.integer("http_max_headers", 100, minimum=1),
        "http_max_header_bytes": f.integer("http_max_header_bytes", 16 * 1024, minimum=1),
        "http_max_head_bytes": f.integer("http_max_head_bytes", 64 * 1024, minimum=1),
        "http_idle_timeout_s": f.number("http_idle_timeout_s", 75.0),
        "http_header_timeout_s": f.number("http_header_timeout_s", 20.0),
        "http_body_timeout_s": f.number("http_body_timeout_s", 30.0),
        "http_max_connections": f.integer("http_max_connections", 10_000, minimum=1),
        "model_control_mode": f.string("model_control_mode", "none", ("none", "poll", "explicit")),
        "repository_poll_secs": f.number("repository_poll_secs", 15.0),
        "load_models": _model_names(f),
        "log_format": f.string("log_format", "text", ("text", "json")),
        "access_log": f.boolean("access_log", False),
        "trace_endpoint": f.string("trace_endpoint", ""),
        "trace_sample_ratio": f.number("trace_sample_ratio", 1.0, 0.0, 1.0),
        "max_tensor_elements": f.integer("max_tensor_elements", 1 << 24, minimum=1),
        "max_bytes_elements": f.integer("max_bytes_elements", 1 << 16, minimum=1),
        "max_json_depth": f.integer("max_json_depth", 32, minimum=1),
        "max_json_containers": f.integer("max_json_containers", 1 << 16, minimum=1),
        "max_decompressed_bytes": f.integer("max_decompressed_bytes", 64 * 1024 * 1024, minimum=1),
        "auth_file": f.string("auth_file", ""),
        "rate_limit_rps": f.number("rate_limit_rps", 0.0),
        "rate_limit_burst": f.integer("rate_limit_burst", 0),
        "tls_cert": f.string("tls_cert", ""),
        "tls_key": f.string("tls_key", ""),
        "tls_client_ca": f.string("tls_client_ca", ""),
        "strict_readiness": f.boolean("strict_readiness", True),
        "exit_on_error": f.boolean("exit_on_error", False),
        "shared_memory": f.string("shared_memory", "none", ("none", "system")),
        "shared_memory_max_regions": f.integer("shared_memory_max_regions", 64, minimum=1),
    }
    f.check_unknown()
    if not data.get("model_repository"):
        raise ConfigError("model_repository: expected a directory (--model-repository)")
    if not isinstance(data["model_repository"], str | Path):
        raise f.fail("model_repository", "a directory path", data["model_repository"])
    data["model_repository"] = Path(data["model_repository"])
    data.update(internal)
    return ServerConfig(**data)


def _model_names(f: _Fields) -> tuple[str, ...]:
    names = f.get("load_models")
    if names is None:
        return ()
    if isinstance(names, str) or not isinstance(names, list | tuple):
        raise f.fail("load_models", "a list of model names", names)
    if not all(isinstance(n, str) and n for n in names):
        raise f.fail("load_models", "a list of model names", names)
    return tuple(names)
