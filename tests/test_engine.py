"""The in-process Engine: the servers' core without sockets."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from rtserve import Engine
from rtserve.errors import InvalidInput, ModelNotFound
from tests.conftest import ROOT, start_server
from tests.models import build_mlp, build_scale


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("engine") / "repo"
    build_mlp(root / "mlp" / "1" / "model.onnx")
    (root / "mlp" / "config.yaml").write_text(
        "max_batch_size: 32\ndynamic_batching: {max_queue_delay_us: 20000}\n"
    )
    build_scale(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text("max_batch_size: 4\n")
    return root


def test_results_equal_the_http_servers(repo: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((3, 256), dtype=np.float32)

    async def run() -> np.ndarray:
        async with Engine.from_repository(repo) as engine:
            return (await engine.infer("mlp", {"input": x}))["output"]

    ours = asyncio.run(run())
    server = start_server(repo, tmp_path / "s")
    try:
        client = httpclient.InferenceServerClient(server.http)
        i = httpclient.InferInput("input", [3, 256], "FP32")
        i.set_data_from_numpy(x)
        theirs = client.infer("mlp", [i]).as_numpy("output")
    finally:
        server.stop()
    assert ours.shape == (3, 10)
    np.testing.assert_array_equal(ours, theirs)


def test_concurrent_calls_batch_together(repo: Path) -> None:
    async def run() -> tuple[list[dict[str, np.ndarray]], bytes]:
        async with Engine.from_repository(repo) as engine:
            rows = [np.full((1, 256), i, np.float32) for i in range(16)]
            outs = await asyncio.gather(*(engine.infer("mlp", {"input": r}) for r in rows))
            return outs, engine.metrics_text()

    outs, metrics = asyncio.run(run())
    assert len(outs) == 16 and all(o["output"].shape == (1, 10) for o in outs)
    # Every row in its own batch would leave the histogram's 1-row bucket holding all 16.
    line = next(
        ln
        for ln in metrics.decode().splitlines()
        if ln.startswith("rtserve_batch_size_bucket") and 'model="mlp"' in ln and 'le="1.0"' in ln
    )
    assert float(line.rsplit(" ", 1)[1]) < 16


def test_errors_are_typed_and_name_the_field(repo: Path) -> None:
    async def run() -> None:
        async with Engine.from_repository(repo) as engine:
            with pytest.raises(ModelNotFound, match="nope"):
                await engine.infer("nope", {"x": np.zeros((1, 4), np.float32)})
            with pytest.raises(InvalidInput, match="'y'"):
                await engine.infer("scale", {"y": np.zeros((1, 4), np.float32)})
            with pytest.raises(InvalidInput, match="x"):
                await engine.infer("scale", {"x": np.zeros((1, 5), np.float32)})
            with pytest.raises(InvalidInput, match="complex"):
                await engine.infer("scale", {"x": np.zeros((1, 4), np.complex64)})
            # The engine keeps serving after bad requests.
            out = await engine.infer("scale", {"x": [[1.0, 2.0, 3.0, 4.0]]}, version="1")
            assert out["y"].tolist() == [[2.0, 4.0, 6.0, 8.0]]
            assert {(m.name, m.state) for m in engine.models()} == {
                ("mlp", "READY"),
                ("scale", "READY"),
            }

    asyncio.run(run())


def test_sync_from_a_plain_script_opens_no_listening_socket(repo: Path, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os
            import numpy as np
            from rtserve import Engine

            def listening_sockets():
                inodes = set()
                for name in ("tcp", "tcp6", "udp", "udp6", "unix"):
                    with open(f"/proc/self/net/{{name}}") as f:
                        for line in list(f)[1:]:
                            cols = line.split()
                            if name == "unix":
                                if cols[5] == "01":  # listening
                                    inodes.add(cols[6])
                            elif cols[3] in ("0A", "07"):  # LISTEN, or a bound UDP socket
                                inodes.add(cols[9])
                mine = set()
                for fd in os.listdir("/proc/self/fd"):
                    try:
                        target = os.readlink(f"/proc/self/fd/{{fd}}")
                    except OSError:
                        continue
                    if target.startswith("socket:["):
                        mine.add(target[8:-1])
                return mine & inodes

            with Engine.from_repository({str(repo)!r}).sync() as engine:
                out = engine.infer("scale", {{"x": np.ones((2, 4), np.float32)}})
                print("ANSWER", out["y"].tolist())
                print("READY", engine.ready())
                print("LISTENING", len(listening_sockets()))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ANSWER [[2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]]" in proc.stdout
    assert "READY True" in proc.stdout
    assert "LISTENING 0" in proc.stdout


def test_frontends_hint_that_more_requests_are_coming(repo: Path) -> None:
    """Without frontends the engine never waits for more rows; a registered hint is asked."""
    engine = Engine.from_repository(repo)
    assert engine.more_expected() is False
    hints = [False]
    engine.add_activity(lambda: hints[0])
    assert engine.more_expected() is False
    hints[0] = True
    assert engine.more_expected() is True


@pytest.fixture(scope="module")
def typed_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An identity model over every V2 datatype (inputs in_<TYPE>, outputs out_<TYPE>)."""
    from tests.models import build_identity_all_types

    root = tmp_path_factory.mktemp("engine-typed") / "repo"
    build_identity_all_types(root / "dtypes" / "1" / "model.onnx")
    (root / "dtypes" / "config.yaml").write_text("max_batch_size: 0\n")
    return root


def _all_types(**overrides: object) -> dict[str, object]:
    feeds: dict[str, object] = {
        "in_FP32": [[1.0, 2.0, 3.0]], "in_FP16": [[1.0, 2.0, 3.0]], "in_FP64": [[1.0, 2.0, 3.0]],
        "in_INT8": [[1, 2, 3]], "in_INT16": [[1, 2, 3]], "in_INT32": [[1, 2, 3]],
        "in_INT64": [[1, 2, 3]], "in_UINT8": [[1, 2, 3]], "in_BOOL": [[True, False, True]],
        "in_BYTES": [["a", "b", "c"]],
    }  # fmt: skip
    feeds.update(overrides)
    return feeds


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("in_INT8", [[300, 1, 2]], "expected INT8 values, which range from -128 to 127"),
        ("in_UINT8", [[-1, 1, 2]], "expected UINT8 values, which range from 0 to 255"),
        ("in_INT64", [[1.7, 1, 2]], "expected INT64 values (integers)"),
        ("in_INT32", [[True, False, True]], "expected INT32 values, got booleans"),
        ("in_INT64", [[2**70, 1, 2]], "expected INT64 values, got object"),
        ("in_BOOL", [["False", "0", ""]], "expected BOOL values, got <U5 values"),
        ("in_BOOL", [[1, 0, 1]], "expected BOOL values (true / false), got int64"),
        ("in_FP32", [[1e40, 1.0, 2.0]], "a number beyond FP32's range"),
        ("in_FP16", [[1e6, 1.0, 2.0]], "a number beyond FP16's range"),
        ("in_BYTES", [["\ud800", "b", "c"]], "not valid Unicode"),
    ],
)
def test_lists_are_checked_as_json_is_not_wrapped(
    typed_repo: Path, name: str, value: object, needle: str
) -> None:
    async def run() -> None:
        async with Engine.from_repository(typed_repo) as engine:
            with pytest.raises(
                InvalidInput,
                match=f"inputs.{name}: .*{re.escape(needle)}",
            ):
                await engine.infer("dtypes", _all_types(**{name: value}))
            out = await engine.infer("dtypes", _all_types())  # still serving
            assert out["out_INT8"].tolist() == [[1, 2, 3]]

    asyncio.run(run())


def test_big_endian_arrays_int_versions_and_bad_parameters(repo: Path) -> None:
    async def run() -> None:
        async with Engine.from_repository(repo) as engine:
            x = np.array([[1, 2, 3, 4]], dtype=">f4")
            out = await engine.infer("scale", {"x": x}, version=1)  # type: ignore[arg-type]
            assert out["y"].tolist() == [[2.0, 4.0, 6.0, 8.0]]
            with pytest.raises(InvalidInput, match="parameters: expected a mapping"):
                await engine.infer("scale", {"x": x}, parameters=[1])  # type: ignore[arg-type]
            with pytest.raises(InvalidInput, match="version: expected a version string"):
                await engine.infer("scale", {"x": x}, version=1.5)  # type: ignore[arg-type]

    asyncio.run(run())


def test_another_event_loop_is_refused_not_left_waiting(repo: Path) -> None:
    import threading

    engine = Engine.from_repository(repo)
    started = threading.Event()
    done = threading.Event()
    errors: list[BaseException] = []

    async def own_loop() -> None:
        await engine.start()
        with pytest.raises(RuntimeError, match="already started"):
            await engine.start()
        started.set()
        while not done.is_set():
            await asyncio.sleep(0.01)
        await engine.stop()

    owner = threading.Thread(target=lambda: asyncio.run(own_loop()))
    owner.start()
    try:
        assert started.wait(60)
        x = {"x": np.ones((1, 4), np.float32)}
        try:
            asyncio.run(asyncio.wait_for(engine.infer("scale", x), 10))
        except BaseException as exc:  # noqa: BLE001 (the test checks which)
            errors.append(exc)
    finally:
        done.set()
        owner.join(30)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "runs on the event loop that started it" in str(errors[0])
    sync = Engine.from_repository(repo).sync().start()
    try:
        assert sync.start() is sync  # (idempotent: tests/test_engine_lifecycle.py)
        assert sync.infer("scale", x)["y"].tolist() == [[2.0] * 4]
    finally:
        sync.stop()


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"load_models": "mlp"}, "load_models: expected a list of model names"),
        ({"strict_readiness": "no"}, "strict_readiness: expected true or false"),
        ({"max_tensor_elements": -1}, "max_tensor_elements: expected an integer >= 1"),
        ({"trace_sample_ratio": 5}, "trace_sample_ratio: expected a number from 0 to 1"),
        ({"bogus": 1}, "bogus: unknown field"),
    ],
)
def test_engine_settings_are_checked_like_the_config_file(
    repo: Path, settings: dict[str, object], needle: str
) -> None:
    from rtserve.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        Engine.from_repository(repo, **settings)


def test_uint64_lists_keep_their_values_and_bad_ones_are_named() -> None:
    """numpy reads [2**64 - 1, 1] as float64: the list is read exactly instead."""
    from rtserve.engine import _from_list

    got = _from_list("u", [[2**64 - 1, 1], [2**63, 0]], "UINT64")
    assert got.dtype == np.uint64 and got.tolist() == [[2**64 - 1, 1], [2**63, 0]]
    with pytest.raises(InvalidInput, match="inputs.u: expected UINT64 values"):
        _from_list("u", [2**64, 1], "UINT64")
    with pytest.raises(InvalidInput, match=r"inputs.i: expected INT64 values \(integers\)"):
        _from_list("i", [2**63, 1.5], "INT64")


def test_a_stopped_engine_is_not_restarted_and_a_fork_gets_an_error(repo: Path) -> None:
    """start() after stop() said nothing and served nothing; a SyncEngine used in a forked
    child waited for ever on a loop thread that is not there."""
    import os

    async def run() -> None:
        engine = Engine.from_repository(repo)
        await engine.start()
        await engine.stop()
        with pytest.raises(RuntimeError, match="cannot be started again after stop"):
            await engine.start()

    asyncio.run(run())
    sync = Engine.from_repository(repo).sync().start()
    try:
        x = {"x": np.ones((1, 4), np.float32)}
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: an error at once, then exit
            try:
                sync.infer("scale", x)
                os.write(write, b"answered")
            except RuntimeError as exc:
                os.write(write, str(exc).encode()[:200])
            finally:
                os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        message = os.read(read, 300).decode()
        os.close(read)
        assert status == 0 and "in a forked process create and start a new Engine" in message
        assert sync.infer("scale", x)["y"].tolist() == [[2.0] * 4]  # the parent's still serves
    finally:
        sync.stop()


def test_stop_ends_generations_past_the_grace_period(tmp_path: Path) -> None:
    """A generation that would run for long holds stop() only for the grace period, then
    ends with ShuttingDown (a short one beside it completed)."""
    from rtserve.errors import ShuttingDown
    from tests.llm_models import build_llm

    build_llm(tmp_path, "tiny")

    async def run() -> tuple[list[str], float]:
        engine = Engine.from_repository(tmp_path)
        await engine.start()
        outcomes: list[str] = []

        async def consume(max_tokens: int) -> None:
            try:
                async for _ in engine.generate(
                    "tiny", "the cat", max_tokens=max_tokens, ignore_eos=True, temperature=0
                ):
                    pass
                outcomes.append("done")
            except ShuttingDown:
                outcomes.append("cut")

        long = asyncio.create_task(consume(500))
        await asyncio.create_task(consume(3))  # a short one, alongside
        assert not long.done()
        started = time.monotonic()
        await engine.stop(grace_period_s=0.02)
        await long
        return sorted(outcomes), time.monotonic() - started

    outcomes, took = asyncio.run(run())
    assert outcomes == ["cut", "done"]
    assert took < 10, took


def test_a_kv_pool_smaller_than_max_model_len_caps_it(tmp_path: Path) -> None:
    """Every request without max_tokens was refused ("exceeds the KV pool") while the model
    said max_model_len 512; the cap is now what the pool holds, and such requests run."""
    from rtserve.core import generation
    from tests.llm_models import build_llm

    build_llm(tmp_path, "tiny", llm={"kv_cache_bytes": 1 << 16})

    async def run() -> tuple[int, str | None]:
        async with Engine.from_repository(tmp_path) as engine:
            llm = generation.engine_of(engine.registry.get("tiny"))
            assert llm is not None
            events = [
                e
                async for e in engine.generate("tiny", "the cat", ignore_eos=True, max_tokens=None)
            ]
            return llm.max_model_len, events[-1].finish_reason

    max_len, reason = asyncio.run(run())
    assert max_len < 512 and reason == "length"
