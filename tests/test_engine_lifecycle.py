"""The Engine API under misuse: ``SyncEngine.start`` / ``stop`` from several threads at
once, stop without start, stop twice, use after stop, stop from the engine's own thread.
Each leaves one engine (or none) and no thread behind, and a misuse gets a clear error."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rtserve import Engine
from tests.models import build_scale

X = {"x": np.ones((1, 4), np.float32)}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lifecycle") / "repo"
    build_scale(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text("max_batch_size: 4\n")
    return root


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def _settled(before: set[threading.Thread], limit_s: float = 5.0) -> set[threading.Thread]:
    """The threads started since ``before`` still alive once given ``limit_s`` to end."""
    deadline = time.monotonic() + limit_s
    while True:
        extra = {t for t in _threads() - before if t.is_alive()}
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.02)


def _at_once(n: int, call: Callable[[], Any]) -> list[Any]:
    """``call`` from ``n`` threads released together; each one's result or exception."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def one(i: int) -> None:
        barrier.wait()
        try:
            results[i] = call()
        except BaseException as exc:  # noqa: BLE001 (the test looks at which)
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_three_threads_starting_at_once_share_one_engine_and_leak_nothing(repo: Path) -> None:
    before = _threads()
    sync = Engine.from_repository(repo).sync()
    results = _at_once(3, sync.start)
    assert results == [sync, sync, sync]  # each caller got the started engine, no error
    loops = [t for t in _threads() if t.name == "rtserve-engine"]
    assert len(loops) == 1, loops
    assert sync.engine.started
    assert sync.infer("scale", X)["y"].tolist() == [[2.0] * 4]
    assert sync.start() is sync  # started: the same engine, at once
    assert _at_once(3, sync.stop) == [None, None, None]
    assert not sync.engine.started
    assert _settled(before) == set()


def test_each_thread_starting_its_own_sync_view_shares_one_start(repo: Path) -> None:
    """``engine.sync()`` is one object: threads that each call ``engine.sync().start()``
    share one loop thread (a second SyncEngine used to fail with "already started")."""
    before = _threads()
    engine = Engine.from_repository(repo)
    assert engine.sync() is engine.sync()
    results = _at_once(3, lambda: engine.sync().start())
    assert results == [engine.sync()] * 3
    assert len([t for t in _threads() if t.name == "rtserve-engine"]) == 1
    engine.sync().stop()
    assert _settled(before) == set()


def test_stop_without_start_and_stop_twice_do_nothing(repo: Path) -> None:
    before = _threads()
    sync = Engine.from_repository(repo).sync()
    sync.stop()  # never started
    sync.stop()
    sync.start()  # (stop without start did not spend the engine)
    sync.stop()
    sync.stop()
    assert _settled(before) == set()


def test_use_after_stop_is_a_clear_error(repo: Path) -> None:
    sync = Engine.from_repository(repo).sync().start()
    sync.stop()
    with pytest.raises(RuntimeError, match="the engine was stopped; create and start a new"):
        sync.infer("scale", X)
    with pytest.raises(RuntimeError, match="was stopped"):
        sync.run(asyncio.sleep(0))
    with pytest.raises(RuntimeError, match="cannot be started again after stop"):
        sync.start()
    with pytest.raises(RuntimeError, match="cannot be started again after stop"), sync:
        pass

    async def async_after_stop() -> None:
        engine = Engine.from_repository(repo)
        await engine.start()
        await engine.stop()
        await engine.stop()  # twice: nothing more to do
        with pytest.raises(RuntimeError, match="the engine was stopped; create and start a new"):
            await engine.infer("scale", X)
        with pytest.raises(RuntimeError, match="the engine was stopped"):
            async for _ in engine.generate("scale", prompt="a"):
                pass

    asyncio.run(async_after_stop())


def test_the_async_engine_before_start_and_stopped_by_two_tasks(repo: Path) -> None:
    """Before start, a call said "unknown model" (the repository not read yet); stop
    without start spent the engine; a second stop() returned before the first finished."""

    async def run() -> None:
        engine = Engine.from_repository(repo)
        with pytest.raises(RuntimeError, match="the engine is not started: `await engine.start"):
            await engine.infer("scale", X)
        await engine.stop()  # never started: nothing to do, and it may start after
        async with engine:
            assert (await engine.infer("scale", X))["y"].tolist() == [[2.0] * 4]
            slow = asyncio.ensure_future(engine.infer("scale", X))
            await asyncio.sleep(0)
            stops = [asyncio.ensure_future(engine.stop()) for _ in range(3)]
            started_when_done: list[bool] = []
            for stop in stops:
                stop.add_done_callback(lambda _: started_when_done.append(engine.started))
            await asyncio.gather(*stops)
            # Every stop returned once the engine was stopped, the request accepted answered.
            assert started_when_done == [False, False, False]
            assert (await slow)["y"].tolist() == [[2.0] * 4]

    asyncio.run(run())


def test_a_call_racing_stop_gets_an_answer_or_an_error_never_a_wait(repo: Path) -> None:
    """Calls from other threads while the engine stops: each returns (answer or error)."""
    sync = Engine.from_repository(repo).sync().start()
    done = threading.Event()
    outcomes: list[str] = []

    def caller() -> None:
        while not done.is_set():
            try:
                sync.infer("scale", X)
                outcomes.append("answered")
            except BaseException as exc:  # noqa: BLE001
                outcomes.append(type(exc).__name__)
                if isinstance(exc, RuntimeError):
                    return

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    sync.stop()
    done.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a caller waits for ever"
    assert "answered" in outcomes
    assert set(outcomes) <= {"answered", "ShuttingDown", "RuntimeError", "CancelledError"}


def test_stop_from_the_engines_own_thread_is_refused(repo: Path) -> None:
    sync = Engine.from_repository(repo).sync().start()
    try:

        async def stop_from_inside() -> None:
            sync.stop()

        with pytest.raises(RuntimeError, match="from its own loop thread"):
            sync.run(stop_from_inside())

        async def call_from_inside() -> None:
            sync.infer("scale", X)

        with pytest.raises(RuntimeError, match="from its own loop thread"):
            sync.run(call_from_inside())
        assert sync.infer("scale", X)["y"].tolist() == [[2.0] * 4]  # still serving
    finally:
        sync.stop()


def test_a_failed_start_leaves_no_thread_and_may_be_retried(tmp_path: Path) -> None:
    before = _threads()
    engine = Engine.from_repository(tmp_path, model_control_mode="explicit", load_models=("x",))
    sync = engine.sync()
    with pytest.raises(Exception):  # noqa: B017, PT011 (the load's own error)
        sync.start()
    assert _settled(before) == set()
    assert not engine.started
