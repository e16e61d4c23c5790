"""The dataplane: the single entry for health, metadata and inference.

Both frontends decode into an ``InferRequest`` and call ``infer``; it finds the model,
checks the inputs against the model's precomputed signature, applies the deadline and the
response cache, and submits to the model's batcher.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rtserve import __version__
from rtserve.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    RTServeError,
    ShuttingDown,
)
from rtserve.protocol.types import InferRequest, InferResponse, Tensor, Timings
from rtserve.repository import ModelRepository, ModelVersion

EXTENSIONS = [
    "binary_tensor_data",
    "model_configuration",
    "statistics",
    "model_repository",
    "schedule_policy",
]
_now = time.perf_counter_ns


def outcome_of(exc: BaseException) -> str:
    if isinstance(exc, Overloaded | ShuttingDown):
        return "overloaded"
    if isinstance(exc, DeadlineExceeded):
        return "timeout"
    if isinstance(exc, ModelNotFound):
        return "not_found"
    if isinstance(exc, RTServeError) and exc.http_status < 500:
        return "client_error"
    return "error"


def _timeout_s(request: InferRequest, mv: ModelVersion) -> float:
    """The V2 ``timeout`` request parameter, in microseconds (as Triton's clients send it)."""
    value = request.parameters.get("timeout")
    if value is None:
        return mv.config.dynamic_batching.default_timeout_us / 1e6
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise InvalidInput(
            f"parameters.timeout: expected microseconds (a number >= 0), got {value!r}"
        )
    return float(value) / 1e6


@dataclass(slots=True)
class Checked:
    feeds: dict[str, np.ndarray]
    rows: int
    wanted: list[str]
    timeout_s: float


class DataPlane:
    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository
        self.started = False
        self.draining = False
        self.drain_started_ns = 0

    def begin_drain(self) -> None:
        self.drain_started_ns = time.perf_counter_ns()
        self.draining = True

    # ------------------------------------------------------------------ health
    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.started and not self.draining

    def model_ready(self, name: str, version: str = "") -> bool:
        mv = self.repository.get_loaded(name, version)
        return mv.ready and not self.draining

    # ------------------------------------------------------------------ metadata
    def server_metadata(self) -> dict[str, Any]:
        return {"name": "rtserve", "version": __version__, "extensions": EXTENSIONS}

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        mv = self.repository.get_loaded(name, version)
        model = self.repository.models[name]
        batch = [-1] if mv.config.max_batch_size > 0 else []
        return {
            "name": name,
            "versions": list(model.versions),
            "platform": mv.runtime.platform,
            "inputs": [
                {"name": s.name, "datatype": s.datatype, "shape": [*batch, *s.shape]}
                for s in mv.inputs.values()
            ],
            "outputs": [
                {"name": s.name, "datatype": s.datatype, "shape": [*batch, *s.shape]}
                for s in mv.outputs.values()
            ],
        }

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        """The model's configuration in the shape of Triton's model-configuration extension."""
        mv = self.repository.get_loaded(name, version)
        cfg = mv.config
        db = cfg.dynamic_batching
        return {
            "name": name,
            "platform": mv.runtime.platform,
            "backend": "onnxruntime",
            "max_batch_size": cfg.max_batch_size,
            "input": [
                {
                    "name": s.name,
                    "data_type": f"TYPE_{_config_type(s.datatype)}",
                    "dims": list(s.shape) or [1],
                }
                for s in mv.inputs.values()
            ],
            "output": [
                {
                    "name": s.name,
                    "data_type": f"TYPE_{_config_type(s.datatype)}",
                    "dims": list(s.shape) or [1],
                }
                for s in mv.outputs.values()
            ],
            "dynamic_batching": {
                "preferred_batch_size": list(db.preferred_batch_sizes),
                "max_queue_delay_microseconds": db.max_queue_delay_us,
            },
            "instance_group": [{"name": name, "kind": "KIND_CPU", "count": cfg.instance_count}],
        }

    def repository_index(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for model in self.repository.models.values():
            if model.error:
                rows.append(
                    {
                        "name": model.name,
                        "version": "",
                        "state": "UNAVAILABLE",
                        "reason": model.error,
                    }
                )
            for v in model.versions.values():
                state = "READY" if v.ready else "UNAVAILABLE"
                rows.append(
                    {"name": model.name, "version": v.version, "state": state, "reason": ""}
                )
        return rows

    # ------------------------------------------------------------------ inference
    def resolve(self, request: InferRequest) -> ModelVersion:
        return self.resolve_name(request.model_name, request.model_version, request.timings)

    def resolve_name(self, name: str, version: str, timings: Timings) -> ModelVersion:
        """Find the model version; during a drain only requests received before it began
        are accepted."""
        if self.draining and timings.received >= self.drain_started_ns:
            raise ShuttingDown("server is shutting down; not accepting new requests")
        return self.repository.get(name, version)

    def check(self, request: InferRequest, mv: ModelVersion) -> Checked:
        """Validate the request against the model: the feeds, rows, outputs and timeout."""
        feeds, rows = self._check_inputs(request, mv)
        return Checked(feeds, rows, self._check_outputs(request, mv), _timeout_s(request, mv))

    @staticmethod
    def enqueue(
        request: InferRequest, mv: ModelVersion, checked: Checked
    ) -> asyncio.Future[dict[str, np.ndarray]]:
        return mv.batcher.submit(checked.feeds, checked.rows, request.timings, checked.timeout_s)

    def response(
        self,
        request: InferRequest,
        mv: ModelVersion,
        results: dict[str, np.ndarray],
        wanted: list[str],
    ) -> InferResponse:
        return InferResponse(mv.name, mv.version, self._select(mv, results, wanted), request.id)

    def cached(
        self, request: InferRequest, mv: ModelVersion
    ) -> tuple[InferResponse | None, bytes | None]:
        """The synchronous L1 probe: (response, None) on a hit; (None, key) on a miss, to
        finish with :meth:`fill`; (None, None) when the model has no cache or the request
        opted out."""
        if mv.cache is None:
            return None, None
        outputs, key = mv.cache.lookup_memory(request)
        if outputs is not None:
            request.timings.cache = "memory"
            return InferResponse(mv.name, mv.version, outputs, request.id), None
        if key is None:
            request.timings.cache = "bypass"
        return None, key

    async def fill(
        self, request: InferRequest, mv: ModelVersion, checked: Checked, key: bytes
    ) -> InferResponse:
        """After an L1 miss: single-flight, then Redis, then the model."""

        async def run() -> list[Tensor]:
            results = await self.enqueue(request, mv, checked)
            return self._select(mv, results, checked.wanted)

        outputs, tier = await mv.cache.fill(key, request, run)
        request.timings.cache = tier or "miss"
        return InferResponse(mv.name, mv.version, outputs, request.id)

    async def infer(self, request: InferRequest, mv: ModelVersion | None = None) -> InferResponse:
        if mv is None:
            mv = self.resolve(request)
        checked = self.check(request, mv)
        hit, key = self.cached(request, mv)
        if hit is not None:
            return hit
        if key is not None:
            return await self.fill(request, mv, checked, key)
        results = await self.enqueue(request, mv, checked)
        return self.response(request, mv, results, checked.wanted)

    @staticmethod
    def _select(
        mv: ModelVersion, results: dict[str, np.ndarray], wanted: list[str]
    ) -> list[Tensor]:
        specs = mv.outputs
        out = []
        for name in wanted:
            arr = results[name]
            out.append(Tensor(name, specs[name].datatype, arr.shape, arr))
        return out

    @staticmethod
    def _check_outputs(request: InferRequest, mv: ModelVersion) -> list[str]:
        if not request.outputs:
            return list(mv.outputs)
        names = []
        for i, out in enumerate(request.outputs):
            if out.name not in mv.outputs:
                raise InvalidInput(
                    f"outputs[{i}].name: model '{mv.name}' has no output '{out.name}' "
                    f"(expected one of: {', '.join(mv.outputs)})"
                )
            names.append(out.name)
        return names

    @staticmethod
    def _check_inputs(request: InferRequest, mv: ModelVersion) -> tuple[dict[str, np.ndarray], int]:
        specs = mv.inputs
        max_batch = mv.config.max_batch_size
        feeds: dict[str, np.ndarray] = {}
        rows = 1
        for t in request.inputs:
            spec = specs.get(t.name)
            if spec is None:
                raise InvalidInput(
                    f"input '{t.name}': model '{mv.name}' has no such input "
                    f"(expected: {', '.join(specs)})"
                )
            if t.name in feeds:
                raise InvalidInput(f"input '{t.name}': given more than once")
            if t.datatype != spec.datatype:
                raise InvalidInput(
                    f"input '{t.name}': datatype {t.datatype} does not match the model's {spec.datatype}"
                )
            shape = t.shape
            expected = spec.shape
            if max_batch > 0:
                if len(shape) != len(expected) + 1 or shape[0] < 1:
                    raise InvalidInput(
                        f"input '{t.name}': shape {list(shape)} does not match the model's "
                        f"{[-1, *expected]} (first dimension is the batch)"
                    )
                n = shape[0]
                if n > max_batch:
                    raise InvalidInput(
                        f"input '{t.name}': batch of {n} rows exceeds the model's "
                        f"max_batch_size {max_batch}"
                    )
                if feeds and n != rows:
                    raise InvalidInput(
                        f"input '{t.name}': batch size {n} differs from the other inputs' {rows}"
                    )
                rows = n
                dims = shape[1:]
            else:
                dims = shape
                if len(dims) != len(expected):
                    raise InvalidInput(
                        f"input '{t.name}': shape {list(shape)} does not match the model's {list(expected)}"
                    )
            for got, want in zip(dims, expected, strict=True):
                if want != -1 and got != want:
                    shown = [-1, *expected] if max_batch > 0 else list(expected)
                    raise InvalidInput(
                        f"input '{t.name}': shape {list(shape)} does not match the model's {shown}"
                    )
            feeds[t.name] = t.data
        if len(feeds) != len(specs):
            missing = [n for n in specs if n not in feeds]
            raise InvalidInput(
                f"missing input(s) {', '.join(repr(m) for m in missing)} for model '{mv.name}'"
            )
        return feeds, rows


def _config_type(datatype: str) -> str:
    return "STRING" if datatype == "BYTES" else datatype
