"""The body of a model load request, checked before any of it reaches the config parser.

``POST /v2/repository/models/{name}/load`` with an optional body
``{"parameters": {"config": <an object, or the same as a JSON string>}}`` (gRPC
``RepositoryModelLoad``: the parameter ``config``, a JSON string; what tritonclient's
``load_model(name, config=...)`` sends on both). The config is partial: it is merged over the
model's ``config.yaml`` (mappings field by field, any other value replaced).

Whoever reaches the port may send it (auth is off by default), so it is held to less than a
file: at most ``MAX_LOAD_BODY_BYTES``, and only the fields of ``NETWORK_FIELDS``, within
bounds that keep one load cheap (threads within the CPUs this process may use, warmup within
``max_batch_size``, a bounded memory cache). URLs, environment variable names, paths, the
backend, tensors and ensemble steps come only from files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from rtserve.config import (
    AUTO_BATCH,
    DEFAULT_MAX_BATCH,
    MAX_CONFIG_BYTES,
    ModelConfig,
    version_policy,
)
from rtserve.config import shown_value as _shown
from rtserve.errors import InvalidInput, PayloadTooLarge
from rtserve.protocol.limits import shown

MAX_LOAD_BODY_BYTES = MAX_CONFIG_BYTES  # the size limit of a config file on disk
WHERE = "load request parameters.config"  # how errors name what the body set
# Bounds on what the network may set (a config file may set more).
MAX_NETWORK_BATCH = 1024
MAX_NETWORK_QUEUE = 1 << 16
MAX_NETWORK_CACHE_BYTES = 1 << 30
MAX_NETWORK_WARMUP_ITERATIONS = 100
MAX_NETWORK_LIST = 16
MAX_NETWORK_STRING = 100

Check = Callable[[Any, str], None]
FILE_ONLY = "file only"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _refuse(path: str, expected: str, value: Any) -> InvalidInput:
    return InvalidInput(f"{WHERE}.{path}: expected {expected}, got {_shown(value)}")


def _integer(maximum: int | Callable[[], int] | None = None, minimum: int = 0) -> Check:
    def check(value: Any, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _refuse(path, f"an integer >= {minimum}", value)
        limit = maximum() if callable(maximum) else maximum
        if limit is not None and value > limit:
            raise _refuse(path, f"an integer <= {limit} over the network", value)

    return check


def _number(value: Any, path: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _refuse(path, "a number", value)


def _boolean(value: Any, path: str) -> None:
    if not isinstance(value, bool):
        raise _refuse(path, "true or false", value)


def _string(value: Any, path: str) -> None:
    if not isinstance(value, str) or len(value) > MAX_NETWORK_STRING:
        raise _refuse(path, f"a string of at most {MAX_NETWORK_STRING} characters", value)


def _int_list(maximum: int | None = MAX_NETWORK_BATCH) -> Check:
    def check(value: Any, path: str) -> None:
        if (
            not isinstance(value, list)
            or len(value) > MAX_NETWORK_LIST
            or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
        ):
            raise _refuse(path, f"a list of at most {MAX_NETWORK_LIST} integers", value)
        _integer(maximum)(max(value, default=0), path)

    return check


def _version_policy(value: Any, path: str) -> None:
    try:
        version_policy(value)
    except ValueError as exc:
        raise _refuse(path, str(exc), value) from None


Schema = Mapping[str, Any]  # field -> Check, FILE_ONLY or a nested Schema

NETWORK_FIELDS: Schema = {
    "name": _string,
    "max_batch_size": _integer(MAX_NETWORK_BATCH),
    "dynamic_batching": {
        "max_queue_delay_us": _integer(),
        "preferred_batch_sizes": _int_list(),
        "max_queue_size": _integer(MAX_NETWORK_QUEUE),
        "default_timeout_us": _integer(),
        "adaptive_delay": _boolean,
    },
    "instance_count": _integer(usable_cpus),
    "onnxruntime": {
        # (0, ONNX Runtime's "one per core", would dodge the thread check below)
        "intra_op_threads": _integer(usable_cpus, minimum=1),
        "inter_op_threads": _integer(usable_cpus),
        "graph_optimization_level": _string,
        "execution": _string,
        "execution_providers": FILE_ONLY,
    },
    "warmup": {
        "batch_sizes": _int_list(),
        "iterations": _integer(MAX_NETWORK_WARMUP_ITERATIONS),
    },
    "version_policy": _version_policy,
    "slo": {"p99_ms": _number, "p50_ms": _number},
    "priority_levels": _integer(),
    "default_priority": _integer(),
    "response_cache": {
        "enabled": _boolean,
        "memory": {"max_bytes": _integer(MAX_NETWORK_CACHE_BYTES), "ttl_s": _number},
        "round_floats": _integer(15),
        "redis": FILE_ONLY,
    },
    "backend": FILE_ONLY,
    "inputs": FILE_ONLY,
    "outputs": FILE_ONLY,
    "labels": FILE_ONLY,
    "python": FILE_ONLY,
    "torch": FILE_ONLY,
    "steps": FILE_ONLY,
    # Tree backends' sections (allow_pickle: a pickle runs code; never from the network).
    "xgboost": FILE_ONLY,
    "lightgbm": FILE_ONLY,
    "catboost": FILE_ONLY,
    "sklearn": FILE_ONLY,
}


def check_fields(config: Mapping[str, Any], schema: Schema = NETWORK_FIELDS, at: str = "") -> None:
    """Refuse (400, naming the field) anything the network may not set or that is not a
    config field at all; check the type and network bound of every value that is set."""
    for key, value in config.items():
        path = f"{at}{shown(str(key))}"
        rule = schema.get(key) if isinstance(key, str) else None
        if rule is None:
            settable = ", ".join(k for k, r in schema.items() if r != FILE_ONLY)
            raise InvalidInput(
                f"{WHERE}.{path}: unknown field (settable over the network: {settable})"
            )
        if rule == FILE_ONLY:
            raise InvalidInput(
                f"{WHERE}.{path}: not settable over the network; set it in config.yaml"
            )
        if isinstance(rule, Mapping):
            if isinstance(value, Mapping):
                check_fields(value, rule, f"{path}.")
            elif value is not None and not isinstance(value, bool):  # null/false: unset
                raise _refuse(path, "a mapping", value)
        else:
            rule(value, path)


def check_merged(config: ModelConfig, body: Mapping[str, Any]) -> None:
    """Bounds that need the merged config: threads within the CPUs, warmup within the
    largest batch (32, the default, when the model decides it)."""
    cpus = usable_cpus()
    if "instance_count" in body or _sets(body, "onnxruntime", "intra_op_threads"):
        threads = config.instance_count * config.onnxruntime.intra_op_threads
        if threads > cpus:
            raise InvalidInput(
                f"{WHERE}.instance_count: instance_count x onnxruntime.intra_op_threads is "
                f"{config.instance_count} x {config.onnxruntime.intra_op_threads} = {threads} "
                f"threads; expected at most {cpus} (the CPUs this server may use)"
            )
    if _sets(body, "warmup", "batch_sizes"):
        limit = config.max_batch_size
        if limit == AUTO_BATCH:
            limit = DEFAULT_MAX_BATCH
        sizes = config.warmup.batch_sizes
        if max(sizes) > max(limit, 1):
            raise _refuse("warmup.batch_sizes", f"sizes <= max_batch_size ({limit})", list(sizes))


def _sets(body: Mapping[str, Any], section: str, key: str) -> bool:
    value = body.get(section)
    return isinstance(value, Mapping) and key in value


def merge(base: Any, over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` (a config file's mapping): mappings field by field,
    anything else replaced."""
    out = dict(base) if isinstance(base, Mapping) else {}
    for key, value in over.items():
        old = out.get(key)
        both = isinstance(old, Mapping) and isinstance(value, Mapping)
        out[key] = merge(old, value) if both else value
    return out


def body_parameters(
    body: bytes, what: str, expected: str = "...", null: bool = True
) -> dict[str, Any] | None:
    """The ``parameters`` object of a model-control request's body,
    ``{"parameters": {...}}`` (None: no body or no parameters; ``null``: whether
    ``"parameters": null`` means none); ``what`` names the request in errors."""
    if len(body) > MAX_LOAD_BODY_BYTES:
        raise PayloadTooLarge(
            f"{what} body of {len(body)} bytes exceeds the limit of "
            f"{MAX_LOAD_BODY_BYTES} bytes (the size limit of a config file)"
        )
    if not body.strip():
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"{what} body: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise InvalidInput(
            f'{what} body: expected an object {{"parameters": {{{expected}}}}}, got {_shown(doc)}'
        )
    for key in doc:
        if key != "parameters":
            raise InvalidInput(f"{what} body: {shown(key)}: unknown field (expected: parameters)")
    params = doc.get("parameters")
    if params is None and (null or "parameters" not in doc):
        return None
    if not isinstance(params, dict):
        raise InvalidInput(f"{what} parameters: expected an object, got {_shown(params)}")
    return params


def config_from_body(body: bytes) -> dict[str, Any] | None:
    """The config of an HTTP load request's body (None: load as the files say)."""
    params = body_parameters(body, "load request", '"config": ...')
    return None if params is None else config_from_parameters(params)


def config_from_parameters(params: Mapping[str, Any]) -> dict[str, Any] | None:
    """The config among a load request's parameters (HTTP and gRPC), checked."""
    for key in params:
        if key.startswith("file:"):
            raise InvalidInput(
                f"load request parameters.{shown(key)}: model files cannot be sent in a "
                "load request; put them in the model repository"
            )
        if key != "config":
            raise InvalidInput(
                f"load request parameters.{shown(key)}: unknown parameter (expected: config)"
            )
    config = params.get("config")
    if isinstance(config, str | bytes):
        if len(config) > MAX_LOAD_BODY_BYTES:
            raise PayloadTooLarge(
                f"{WHERE}: {len(config)} bytes exceed the limit of {MAX_LOAD_BODY_BYTES} "
                "bytes (the size limit of a config file)"
            )
        try:
            config = orjson.loads(config)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"{WHERE}: not valid JSON ({exc})") from None
    if config is None:
        return None
    if not isinstance(config, dict):
        raise InvalidInput(f"{WHERE}: expected a model config object, got {_shown(config)}")
    check_fields(config)
    return config or None


def config_from_grpc(parameters: Mapping[str, Any]) -> dict[str, Any] | None:
    """The config of a gRPC ``RepositoryModelLoadRequest.parameters`` (a protobuf map of
    ``ModelRepositoryParameter``)."""
    values: dict[str, Any] = {}
    for key, param in parameters.items():
        choice = param.WhichOneof("parameter_choice")
        values[key] = getattr(param, choice) if choice else None
    return config_from_parameters(values)
