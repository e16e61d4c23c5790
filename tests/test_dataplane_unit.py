"""The dataplane alone: a registry holding a fake-runtime model, no server, no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from rtserve.config import DynamicBatching, ModelConfig
from rtserve.core.dataplane import DataPlane
from rtserve.core.model import BuildContext, ModelVersion
from rtserve.core.registry import ModelEntry, ModelRegistry
from rtserve.errors import (
    InferenceFailed,
    InvalidInput,
    ModelNotFound,
    RTServeError,
    ShuttingDown,
)
from rtserve.observability.metrics import Metrics
from rtserve.protocol.types import InferRequest, InferResponse, RequestedOutput, Tensor, Timings
from rtserve.scheduling.batcher import Batcher
from rtserve.scheduling.policy import DynamicBatchPolicy
from rtserve.scheduling.window import WindowPolicy
from tests.fakes import DoublingRuntime, FakeClock, run_async


def plane() -> tuple[DataPlane, DoublingRuntime, ModelVersion]:
    metrics = Metrics()
    registry = ModelRegistry(BuildContext(metrics, more_expected=lambda: False))
    rt = DoublingRuntime(max_batch_size=8)
    config = ModelConfig(name="double", max_batch_size=8)
    batcher = Batcher(
        "double:1",
        rt,
        WindowPolicy(DynamicBatchPolicy(8, DynamicBatching()), 16, lambda: False),
        batched=True,
        inline=True,
        clock=FakeClock(),
    )
    batcher.start()
    mv = ModelVersion(
        name="double",
        version="1",
        config=config,
        platform="test",
        scheduler=batcher,
        metrics=metrics.model("double", "1"),
        inputs={s.name: s for s in rt.inputs},
        outputs={s.name: s for s in rt.outputs},
        runtime=rt,
        ready=True,
    )
    registry.models["double"] = ModelEntry("double", {"1": mv}, latest="1")
    dp = DataPlane(registry, metrics)
    dp.started = True
    return dp, rt, mv


def request(x: np.ndarray, name: str = "x", model: str = "double") -> InferRequest:
    return InferRequest(model, "", [Tensor(name, "FP32", x.shape, x)])


async def ask(dp: DataPlane, req: InferRequest) -> InferResponse:
    """One request through ``DataPlane.infer``, already decoded."""
    return await dp.infer(req.model_name, req.model_version, req.timings, lambda mv: req)


def submit(dp: DataPlane, req: InferRequest, sink: Callable[..., None]) -> object:
    return dp.submit(req.model_name, req.model_version, req.timings, lambda mv: req, sink)


@run_async
async def test_infer_returns_the_models_outputs_and_records_success_once() -> None:
    dp, rt, mv = plane()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    req = request(x)
    response = await ask(dp, req)
    assert isinstance(response, InferResponse)
    assert response.model_name == "double" and response.model_version == "1"
    np.testing.assert_array_equal(response.outputs[0].data, x * 2)
    assert mv.metrics.outcomes["success"] == 1
    assert mv.metrics.stats.inference_count == 2  # rows


@run_async
async def test_submit_calls_the_sink_exactly_once_then_records_the_request() -> None:
    dp, _, mv = plane()
    calls: list[tuple[object, object]] = []
    submit(
        dp,
        request(np.ones((1, 4), np.float32)),
        lambda r, m, resp, err, final: calls.append((resp, err)),
    )
    await mv.drain()
    await asyncio.sleep(0)
    assert len(calls) == 1 and calls[0][1] is None
    assert mv.metrics.outcomes["success"] == 1


@run_async
async def test_partial_answers_are_delivered_and_only_the_final_one_is_recorded() -> None:
    dp, _, mv = plane()
    req = request(np.ones((1, 4), np.float32))
    calls: list[bool] = []

    def sink(*args: object) -> None:
        calls.append(bool(args[4]))

    for final in (False, False, True):
        dp._deliver(sink, req, mv, None, None, final)
    assert calls == [False, False, True]
    assert mv.metrics.outcomes["success"] == 1


@run_async
async def test_an_error_the_sink_meets_is_recorded_as_the_outcome() -> None:
    dp, _, mv = plane()
    submit(dp, request(np.ones((1, 4), np.float32)), lambda *_: InferenceFailed("encode"))
    await mv.drain()
    await asyncio.sleep(0)
    assert mv.metrics.outcomes["error"] == 1 and mv.metrics.outcomes["success"] == 0


@run_async
async def test_the_decoder_runs_only_after_the_model_is_found() -> None:
    dp, _, _ = plane()
    decoded: list[object] = []
    errors: list[object] = []
    dp.submit(
        "missing", "", Timings(), decoded.append, lambda r, m, resp, err, final: errors.append(err)
    )
    assert decoded == [] and isinstance(errors[0], ModelNotFound)
    assert dp.metrics.unrouted.labels("not_found")._value.get() == 1


@pytest.mark.parametrize(
    ("x", "name", "match"),
    [
        (np.ones((1, 4), np.float32), "nope", r"input 'nope': model 'double' has no such input"),
        (np.ones((1, 5), np.float32), "x", r"shape \[1, 5\] does not match the model's \[-1, 4\]"),
        (np.ones((9, 4), np.float32), "x", r"batch of 9 rows exceeds the model's max_batch_size 8"),
        (np.ones((4,), np.float32), "x", r"first dimension is the batch"),
    ],
)
@run_async
async def test_bad_inputs_are_refused_naming_the_field(
    x: np.ndarray, name: str, match: str
) -> None:
    dp, rt, mv = plane()
    with pytest.raises(InvalidInput, match=match):
        await ask(dp, request(x, name=name))
    assert rt.batches == []


@run_async
async def test_unknown_output_is_refused() -> None:
    dp, _, _ = plane()
    req = request(np.ones((1, 4), np.float32))
    req.outputs = [RequestedOutput("z")]
    with pytest.raises(InvalidInput, match=r"outputs\[0\].name: model 'double' has no output 'z'"):
        await ask(dp, req)


@run_async
async def test_unknown_model_is_not_found_and_counted_as_unrouted() -> None:
    dp, _, _ = plane()
    req = request(np.ones((1, 4), np.float32), model="missing")
    with pytest.raises(ModelNotFound, match="unknown model 'missing'"):
        await ask(dp, req)
    assert dp.metrics.unrouted.labels("not_found")._value.get() == 1


@run_async
async def test_a_runtime_failure_is_a_500_naming_the_model() -> None:
    dp, rt, mv = plane()
    rt.fail_next = RuntimeError("boom")
    req = request(np.ones((1, 4), np.float32))
    with pytest.raises(InferenceFailed, match=r"model 'double:1' failed to run the batch") as info:
        await ask(dp, req)
    assert info.value.http_status == 500
    assert mv.metrics.outcomes["error"] == 1


@run_async
async def test_an_unexpected_exception_still_answers_a_500() -> None:
    dp, _, mv = plane()
    req = request(np.ones((1, 4), np.float32))
    req.parameters = {"timeout": object()}  # a bad parameter: a 400 naming it
    errors: list[RTServeError | None] = []
    submit(dp, req, lambda r, m, resp, err, final: errors.append(err))
    assert len(errors) == 1 and isinstance(errors[0], InvalidInput)
    # A real bug inside the path (a non-RTServeError) becomes a 500 naming only its type.
    mv.inputs = None  # type: ignore[assignment]
    errors.clear()
    submit(
        dp, request(np.ones((1, 4), np.float32)), lambda r, m, resp, err, final: errors.append(err)
    )
    assert isinstance(errors[0], InferenceFailed) and "AttributeError" in errors[0].message


@run_async
async def test_drain_refuses_requests_received_after_it_began() -> None:
    dp, _, _ = plane()
    before = request(np.ones((1, 4), np.float32))
    before.timings = Timings(received=1)
    dp.begin_drain()
    after = request(np.ones((1, 4), np.float32))
    after.timings = Timings(received=dp.drain_started_ns + 1)
    assert (await ask(dp, before)).outputs
    with pytest.raises(ShuttingDown):
        await ask(dp, after)
    assert not dp.ready()


def test_metadata_and_config_are_typed() -> None:
    import asyncio

    async def go() -> None:
        dp, _, _ = plane()
        meta = dp.model_metadata("double")
        assert meta.inputs[0].shape == (-1, 4) and meta.versions == ("1",)
        cfg = dp.model_config("double")
        assert cfg.inputs[0].data_type == "TYPE_FP32" and cfg.max_batch_size == 8
        assert [e.state for e in dp.repository_index()] == ["READY"]
        assert dp.statistics("double")[0].version == "1"

    asyncio.run(go())


@run_async
async def test_an_early_refusal_leaves_no_reference_cycle() -> None:
    """Under overload thousands of requests a second are refused before decoding: each
    refusal must be freed at once, not kept in a cycle (exception -> traceback -> frame ->
    exception) until a cyclic collection, whose pauses would land in admitted requests'
    latency."""
    import gc

    from rtserve.errors import ObjectiveRefused
    from rtserve.scheduling import slo
    from rtserve.scheduling.slo_policy import BatchTimeModel, SLOController, SLOPolicy

    metrics = Metrics()
    rt = DoublingRuntime(max_batch_size=8)
    clock = FakeClock()
    controller = SLOController(slo.Objective(p99_ns=10 * slo.MS), BatchTimeModel(1e6, 1e6))
    batcher = Batcher(
        "slow:1", rt, SLOPolicy(controller, 8, 64), batched=True, inline=True, clock=clock
    )
    batcher.start()
    mv = ModelVersion(
        name="slow", version="1", config=ModelConfig(name="slow", max_batch_size=8),
        platform="test", scheduler=batcher, metrics=metrics.model("slow", "1"),
        inputs={s.name: s for s in rt.inputs}, outputs={s.name: s for s in rt.outputs},
        runtime=rt, ready=True,
    )  # fmt: skip
    feeds = {"x": np.ones((1, 4), dtype=np.float32)}
    queued = []
    with pytest.raises(ObjectiveRefused):
        for _ in range(64):  # the queue grows until admission refuses
            queued.append(batcher.submit(feeds, 1, Timings()))

    registry = ModelRegistry(BuildContext(metrics, more_expected=lambda: False))
    registry.models["slow"] = ModelEntry("slow", {"1": mv}, latest="1")
    dp = DataPlane(registry, metrics)
    dp.started = True
    body = request(np.ones((1, 4), np.float32), model="slow")

    async def refuse_one() -> None:
        try:
            await dp.infer("slow", "", Timings(received=clock.ns), lambda _: body)
        except ObjectiveRefused as exc:
            assert "latency objective" in exc.message
        else:
            raise AssertionError("not refused")

    await refuse_one()  # the first builds what later refusals reuse
    gc.collect()
    gc.disable()
    try:
        for _ in range(100):
            await refuse_one()
        assert gc.collect() == 0  # nothing was left for the cyclic collector
    finally:
        gc.enable()
    await asyncio.gather(*queued)
    await batcher.stop()
