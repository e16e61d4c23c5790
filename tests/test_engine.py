"""The in-process Engine: the servers' core without sockets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
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
