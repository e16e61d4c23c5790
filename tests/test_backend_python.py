"""The python backend: the runtime alone, then served end to end with Triton's clients."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from rtserve.errors import ConfigError, InferenceFailed
from rtserve.runtime.python import PythonModel, load
from tests.conftest import RunningServer, start_server
from tests.models import config_of, edit_config, write_python_model

# A model whose behaviour the first row's MODE picks: answer, raise, exit, hang, die.
MODEL_PY = """
import os, signal, sys, time
import numpy as np

class Model:
    def load(self, context):
        self.scale = float(context.parameters.get("scale", 2.0))
        self.version = context.model_version
        self.loaded_dir = str(context.version_dir)

    def infer(self, inputs):
        x = inputs["X"]
        mode = inputs["MODE"][0, 0]
        if mode == b"raise":
            raise ValueError("x must be positive")
        if b"bad_row" in inputs["MODE"][:, 0].tolist():  # any row: fails a whole batch
            raise ValueError("a bad row")
        if mode == b"exit":
            sys.exit(3)
        if mode == b"interrupt":
            raise KeyboardInterrupt
        if mode == b"none_tag":
            return {"Y": x, "LEN": np.zeros((len(x), 1), np.int64),
                    "TAG": np.full((len(x), 1), None, object), "PID": np.zeros((len(x), 1), np.int64)}
        if mode == b"os_exit":
            os._exit(7)
        if mode == b"segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if mode == b"hang":
            time.sleep(60)
        if mode == b"slow":
            time.sleep(1.0)
        if mode == b"wrong_dtype":
            return {"Y": x.astype(np.float64), "LEN": np.zeros((len(x), 1), np.int64),
                    "TAG": inputs["MODE"], "PID": np.zeros((len(x), 1), np.int64)}
        if mode == b"missing":
            return {"Y": x}
        if mode == b"rows":
            x = x[:1]
        lengths = np.array([[len(m)] for m in inputs["MODE"][:, 0]], dtype=np.int64)
        tags = np.array([[b"v" + self.version.encode() + b":" + m[::-1]]
                         for m in inputs["MODE"][:, 0]], dtype=object)
        pid = np.full((len(x), 1), os.getpid(), dtype=np.int64)
        return {"Y": x * self.scale + 1, "LEN": lengths, "TAG": tags, "PID": pid}
"""

SIGNATURE = {
    "inputs": [
        {"name": "X", "datatype": "FP32", "shape": [4]},
        {"name": "MODE", "datatype": "BYTES", "shape": [1]},
    ],
    "outputs": [
        {"name": "Y", "datatype": "FP32", "shape": [4]},
        {"name": "LEN", "datatype": "INT64", "shape": [1]},
        {"name": "TAG", "datatype": "BYTES", "shape": [1]},
        {"name": "PID", "datatype": "INT64", "shape": [1]},
    ],
}


def write_model(root: Path, name: str, isolation: str, **extra: Any) -> Path:
    config = {
        "backend": "python",
        "max_batch_size": 8,
        **SIGNATURE,
        "dynamic_batching": {"max_queue_delay_us": 2000},
        "python": {"isolation": isolation, "batch_timeout_s": 2, "parameters": {"scale": 3.0}},
        **extra,
    }
    return write_python_model(root, name, config, MODEL_PY)


def user_module(model_dir: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("direct_model", model_dir / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def direct(model_dir: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same class called by hand, as the user would."""
    from rtserve.runtime.python import ModelContext

    config = config_of(model_dir)
    model = user_module(model_dir).Model()
    params = config.backend_options["parameters"]
    model.load(ModelContext(config.name, "1", model_dir, model_dir / "1", config, "cpu", 0, params))
    result: dict[str, np.ndarray] = model.infer(feeds)
    return result


def feeds_for(rows: int, mode: bytes = b"ok", seed: int = 0) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).normal(size=(rows, 4)).astype(np.float32)
    modes = np.array([[mode]] + [[b"row%d" % i] for i in range(1, rows)], dtype=object)
    return {"X": x, "MODE": modes}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], pid: bool = False) -> None:
    np.testing.assert_array_equal(got["Y"], want["Y"])
    np.testing.assert_array_equal(got["LEN"], want["LEN"])
    assert list(got["TAG"].reshape(-1)) == list(want["TAG"].reshape(-1))
    assert got["Y"].dtype == np.float32 and got["LEN"].dtype == np.int64


# ---------------------------------------------------------------------- the runtime alone
@pytest.fixture(params=["thread", "process"])
def runtime(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PythonModel]:
    model_dir = write_model(tmp_path, "echo", request.param)
    rt = load(config_of(model_dir), model_dir / "1")
    yield rt
    rt.close()


def test_runtime_matches_a_direct_call_of_the_class(runtime: PythonModel, tmp_path: Path) -> None:
    for rows in (1, 5):
        feeds = feeds_for(rows, seed=rows)
        got = runtime.run(0, feeds)
        assert_same(got, direct(tmp_path / "echo", feeds))
    assert runtime.platform == "python" and runtime.max_batch_size == 8


def test_user_exception_names_model_type_and_message(runtime: PythonModel) -> None:
    with pytest.raises(InferenceFailed, match=r"'echo'.*ValueError: x must be positive") as info:
        runtime.run(0, feeds_for(2, b"raise"))
    assert "Traceback" not in str(info.value)
    assert runtime.run(0, feeds_for(2))["Y"].shape == (2, 4)  # the instance still serves


def test_sys_exit_fails_only_its_batch(runtime: PythonModel) -> None:
    with pytest.raises(InferenceFailed, match="SystemExit: 3"):
        runtime.run(0, feeds_for(1, b"exit"))
    assert runtime.run(0, feeds_for(1))["LEN"].tolist() == [[2]]
    # KeyboardInterrupt from user code is its batch's error too (it wedged the instance)
    with pytest.raises(InferenceFailed, match="KeyboardInterrupt"):
        runtime.run(0, feeds_for(1, b"interrupt"))
    assert runtime.run(0, feeds_for(1))["LEN"].tolist() == [[2]]


def test_a_hang_is_cut_by_the_batch_timeout(runtime: PythonModel) -> None:
    start = time.monotonic()
    with pytest.raises(InferenceFailed, match="batch_timeout_s=2"):
        runtime.run(0, feeds_for(1, b"hang"))
    assert time.monotonic() - start < 10
    assert runtime.run(0, feeds_for(3))["Y"].shape == (3, 4)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (b"wrong_dtype", r"output 'Y': expected datatype FP32 \(float32\), got float64"),
        (b"missing", r"missing \['LEN', 'TAG', 'PID'\]"),
        (b"rows", r"output 'Y': expected 3 rows along dimension 0"),
        (b"none_tag", r"expected bytes in a BYTES tensor, got NoneType"),
    ],
)
def test_outputs_are_checked_against_the_declaration(
    runtime: PythonModel, mode: bytes, message: str
) -> None:
    with pytest.raises(InferenceFailed, match=message):
        runtime.run(0, feeds_for(3, mode))


@pytest.mark.parametrize("how", [b"os_exit", b"segv"])
def test_process_worker_that_dies_is_restarted(tmp_path: Path, how: bytes) -> None:
    model_dir = write_model(tmp_path, "echo", "process")
    rt = load(config_of(model_dir), model_dir / "1")
    try:
        before = rt.worker_pids()[0]
        expect = "exit code 7" if how == b"os_exit" else "killed by SIGSEGV"
        with pytest.raises(
            InferenceFailed, match=f"worker process died during infer \\({expect}\\)"
        ):
            rt.run(0, feeds_for(2, how))
        out = rt.run(0, feeds_for(2))
        assert int(out["PID"][0, 0]) != before
        assert int(out["PID"][0, 0]) == rt.worker_pids()[0]
    finally:
        rt.close()


def test_process_worker_killed_from_outside_while_idle_or_busy(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "echo", "process")
    rt = load(config_of(model_dir), model_dir / "1")
    try:
        pid = int(rt.run(0, feeds_for(1))["PID"][0, 0])
        os.kill(pid, signal.SIGKILL)  # idle: the next batch restarts it first and succeeds
        time.sleep(0.2)
        pid2 = int(rt.run(0, feeds_for(1))["PID"][0, 0])
        assert pid2 != pid
        errors: list[BaseException] = []

        def slow() -> None:
            try:
                rt.run(0, feeds_for(1, b"slow"))
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=slow)
        t.start()
        time.sleep(0.3)
        os.kill(pid2, signal.SIGKILL)  # busy: that batch fails, clearly
        t.join(10)
        assert len(errors) == 1 and "killed by SIGKILL" in str(errors[0])
        assert int(rt.run(0, feeds_for(1))["PID"][0, 0]) not in (pid, pid2)
    finally:
        rt.close()
    assert not any(p.name.startswith(f"rts{os.getpid()}") for p in Path("/dev/shm").iterdir())


def test_large_and_growing_tensors_cross_shared_memory(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "echo", "process", max_batch_size=4096)
    rt = load(config_of(model_dir), model_dir / "1")
    try:
        for rows in (1, 4096, 3):
            feeds = feeds_for(rows, seed=rows)
            feeds["MODE"][1:] = [[b"\x00" * 200 + b"\xff"]]  # embedded NULs survive framing
            assert_same(rt.run(0, feeds), direct(model_dir, feeds))
    finally:
        rt.close()


def test_instances_are_independent(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "echo", "process", instance_count=2)
    rt = load(config_of(model_dir), model_dir / "1")
    try:
        pids = rt.worker_pids()
        assert len(set(pids)) == 2
        with pytest.raises(InferenceFailed):
            rt.run(1, feeds_for(1, b"os_exit"))
        assert int(rt.run(0, feeds_for(1))["PID"][0, 0]) == pids[0]
    finally:
        rt.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"inputs": None}, r"config.yaml: inputs: required for backend python"),
        ({"python": {"isolation": "fork"}}, r"python.isolation: expected one of thread, process"),
        ({"python": {"batch_timeout_s": -1}}, r"python.batch_timeout_s: expected a number >= 0"),
        (
            {"python": {"load_timeout_s": 5}},
            r"python.load_timeout_s: expected no value with isolation: thread",
        ),
        ({"python": {"workers": 2}}, r"python.workers: unknown field"),
    ],
)
def test_config_errors_name_file_and_field(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    model_dir = write_model(tmp_path, "echo", "thread")
    edit_config(model_dir, change)
    with pytest.raises(ConfigError, match=message):
        load(config_of(model_dir), model_dir / "1")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_broken_model_py_is_a_load_error(tmp_path: Path, isolation: str) -> None:
    model_dir = write_model(tmp_path, "echo", isolation)
    (model_dir / "1" / "model.py").write_text("class Model:\n    def load(self, c):\n        1/0\n")
    with pytest.raises(ConfigError, match=r"model.py: (expected a class Model|Model.load failed)"):
        load(config_of(model_dir), model_dir / "1")


# ---------------------------------------------------------------------- served end to end
@pytest.fixture(scope="module")
def py_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    repo = tmp_path_factory.mktemp("pyrepo")
    write_model(repo, "echo_thread", "thread")
    write_model(repo, "echo_process", "process")
    for isolation in ("thread", "process"):  # a long window: requests sent together batch
        write_model(
            repo, f"window_{isolation}", isolation,
            dynamic_batching={"max_queue_delay_us": 300_000, "adaptive_delay": False},
            python={"isolation": isolation, "batch_timeout_s": 1, "parameters": {"scale": 3.0}},
        )  # fmt: skip
    server = start_server(repo, tmp_path_factory.mktemp("pyserver"))
    yield server, repo
    server.stop()


def http_infer(server: RunningServer, model: str, feeds: dict[str, np.ndarray]) -> Any:
    client = thttp.InferenceServerClient(server.http)
    inputs = []
    for name, arr in feeds.items():
        inp = thttp.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else "FP32")
        inp.set_data_from_numpy(arr, binary_data=True)
        inputs.append(inp)
    return client.infer(model, inputs)


def grpc_infer(server: RunningServer, model: str, feeds: dict[str, np.ndarray]) -> Any:
    client = tgrpc.InferenceServerClient(server.grpc)
    inputs = []
    for name, arr in feeds.items():
        inp = tgrpc.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else "FP32")
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return client.infer(model, inputs)


def as_dict(result: Any) -> dict[str, np.ndarray]:
    return {n: result.as_numpy(n) for n in ("Y", "LEN", "TAG", "PID")}


@pytest.mark.parametrize("model", ["echo_thread", "echo_process"])
def test_served_results_equal_a_direct_call(
    py_server: tuple[RunningServer, Path], model: str
) -> None:
    server, repo = py_server
    feeds = feeds_for(3, seed=7)
    want = direct(repo / model, feeds)
    assert_same(as_dict(http_infer(server, model, feeds)), want)
    assert_same(as_dict(grpc_infer(server, model, feeds)), want)


@pytest.mark.parametrize("model", ["echo_thread", "echo_process"])
@pytest.mark.parametrize("mode", [b"raise", b"exit", b"hang"])
def test_served_failure_fails_only_its_batch(
    py_server: tuple[RunningServer, Path], model: str, mode: bytes
) -> None:
    server, _ = py_server
    with pytest.raises(InferenceServerException) as info:
        http_infer(server, model, feeds_for(1, mode))
    assert info.value.status() == "500"
    text = str(info.value)
    assert model in text and "Traceback" not in text
    expected = {b"raise": "ValueError: x must be positive", b"exit": "SystemExit: 3"}
    assert expected.get(mode, "batch_timeout_s") in text
    with pytest.raises(InferenceServerException) as ginfo:
        grpc_infer(server, model, feeds_for(1, mode))
    assert ginfo.value.status() == "StatusCode.INTERNAL"
    assert as_dict(grpc_infer(server, model, feeds_for(2)))["Y"].shape == (2, 4)


def test_served_process_model_survives_os_exit_and_sigkill(
    py_server: tuple[RunningServer, Path],
) -> None:
    server, _ = py_server
    with pytest.raises(InferenceServerException, match=r"exit code 7"):
        http_infer(server, "echo_process", feeds_for(1, b"os_exit"))
    pid = int(as_dict(http_infer(server, "echo_process", feeds_for(1)))["PID"][0, 0])
    assert pid != server.proc.pid
    errors: list[BaseException] = []

    def slow() -> None:
        try:
            grpc_infer(server, "echo_process", feeds_for(1, b"slow"))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.4)
    os.kill(pid, signal.SIGKILL)
    t.join(10)
    assert len(errors) == 1 and "killed by SIGKILL" in str(errors[0])
    new_pid = int(as_dict(grpc_infer(server, "echo_process", feeds_for(1)))["PID"][0, 0])
    assert new_pid not in (pid, server.proc.pid)
    assert server.proc.poll() is None


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_context_and_sibling_modules(tmp_path: Path, isolation: str) -> None:
    model_dir = write_model(tmp_path, "ctx", isolation, instance_count=2)
    (model_dir / "1" / "helper.py").write_text("OFFSET = 40\n")
    (model_dir / "1" / "model.py").write_text(
        "import numpy as np\n"
        "from helper import OFFSET\n"
        "class Model:\n"
        "    def load(self, context):\n"
        "        import helper  # also importable while loading\n"
        "        assert context.version_dir.name == '1' and context.model_dir.name == 'ctx'\n"
        "        self.base = OFFSET + helper.OFFSET + context.instance\n"
        "    def infer(self, inputs):\n"
        "        n = len(inputs['X'])\n"
        "        return {'Y': inputs['X'], 'LEN': np.full((n, 1), self.base, np.int64),\n"
        "                'TAG': inputs['MODE'], 'PID': np.zeros((n, 1), np.int64)}\n"
    )
    rt = load(config_of(model_dir), model_dir / "1")
    try:
        assert rt.run(0, feeds_for(2))["LEN"].tolist() == [[80], [80]]
        assert rt.run(1, feeds_for(1))["LEN"].tolist() == [[81]]
    finally:
        rt.close()


def _reruns(server: RunningServer, model: str) -> float:
    text = urllib.request.urlopen(f"{server.base}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("rtserve_batch_reruns_total{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no rtserve_batch_reruns_total for {model}")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_raising_request_fails_alone_and_a_hang_is_not_rerun(
    py_server: tuple[RunningServer, Path], isolation: str
) -> None:
    server, repo = py_server
    model = f"window_{isolation}"
    modes = [b"ok", b"bad_row", b"ok", b"ok"]
    feeds = [feeds_for(1, mode, seed=i) for i, mode in enumerate(modes)]

    def call(f: dict[str, np.ndarray]) -> Any:
        try:
            return as_dict(http_infer(server, model, f))
        except InferenceServerException as exc:
            return exc

    before = _reruns(server, model)
    with ThreadPoolExecutor(len(feeds)) as pool:
        answers = list(pool.map(call, feeds))
    for mode, f, answer in zip(modes, feeds, answers, strict=True):
        if mode == b"bad_row":
            assert isinstance(answer, InferenceServerException) and answer.status() == "500"
            assert "ValueError: a bad row" in str(answer)
        else:
            assert_same(answer, direct(repo / model, f))
    assert _reruns(server, model) == before + 1  # batched together, then each alone
    # A hang is the instance's failure, not the data's: no request is run again.
    with ThreadPoolExecutor(3) as pool:
        hung = list(pool.map(call, [feeds_for(1, b"hang", seed=i) for i in range(3)]))
    assert all(
        isinstance(a, InferenceServerException) and "batch_timeout_s" in str(a) for a in hung
    )
    assert _reruns(server, model) == before + 1
