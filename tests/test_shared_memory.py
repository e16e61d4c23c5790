"""Triton's system shared memory extension, against real servers with tritonclient and
perf_analyzer: tensors in /dev/shm in and out, region control, every refusal, and the
feature off by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from examples.build_repository import build_mlp
from rtserve.errors import InvalidInput, PayloadTooLarge
from rtserve.protocol.shared_memory import SharedMemoryRegions
from rtserve.protocol.types import RequestedOutput, Tensor
from rtserve.server.security import Auth, Forbidden, Grant, Guard, Unauthenticated
from tests.conftest import ROOT, RunningServer, post_json, run_perf_analyzer, start_server

PREFIX = f"rtserve_test_{os.getpid()}"
MLP_IN = 256 * 4
MLP_OUT = 10 * 4


def _build_repo(root: Path) -> Path:
    build_mlp(root / "mlp" / "1" / "model.onnx")
    (root / "mlp" / "config.yaml").write_text("max_batch_size: 8\n")
    # strings: out = in (BYTES [batch, 3]); add: z = x + y (FP32 [batch, 4]).
    s_in = helper.make_tensor_value_info("text", TensorProto.STRING, ["b", 3])
    s_out = helper.make_tensor_value_info("echo", TensorProto.STRING, ["b", 3])
    strings = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["echo"])], "strings", [s_in], [s_out]
    )
    adds = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", 4]) for n in "xyz"]
    add = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["z"])], "add", adds[:2], [adds[2]]
    )
    for name, graph in (("strings", strings), ("add", add)):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        (root / name / "1").mkdir(parents=True)
        onnx.save(model, str(root / name / "1" / "model.onnx"))
        (root / name / "config.yaml").write_text("max_batch_size: 4\n")
    return root


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = _build_repo(tmp_path_factory.mktemp("shm_repo"))
    s = start_server(repo, tmp_path_factory.mktemp("shm_server"), "--shared-memory", "system")
    yield s
    s.stop()


class Regions:
    """Regions this test created in /dev/shm, destroyed afterwards."""

    def __init__(self) -> None:
        self.handles: dict[str, Any] = {}

    def create(self, name: str, size: int, *values: np.ndarray) -> tuple[str, Any]:
        key = f"/{PREFIX}_{name}"
        handle = self.handles[name] = shm.create_shared_memory_region(name, key, size)
        if values:
            shm.set_shared_memory_region(handle, list(values))
        return key, handle

    def destroy(self) -> None:
        for handle in self.handles.values():
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions(shm_server: RunningServer) -> Iterator[Regions]:
    r = Regions()
    yield r
    httpclient.InferenceServerClient(shm_server.http).unregister_system_shared_memory()
    r.destroy()


def _mlp_input(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 256)).astype(np.float32)


# ---------------------------------------------------------------------- inference
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_in_system_shared_memory_equal_inline_inference(
    shm_server: RunningServer, regions: Regions, protocol: str
) -> None:
    mod: Any = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(shm_server.http if protocol == "http" else shm_server.grpc)
    x = _mlp_input(1)
    inline_in = mod.InferInput("input", [1, 256], "FP32")
    inline_in.set_data_from_numpy(x)
    expected = client.infer("mlp", [inline_in]).as_numpy("output")

    in_key, _ = regions.create("in", MLP_IN, x)
    out_key, out_handle = regions.create("out", 100 + MLP_OUT)
    client.register_system_shared_memory("in", in_key, MLP_IN)
    client.register_system_shared_memory("out", out_key, 100 + MLP_OUT)
    inp = mod.InferInput("input", [1, 256], "FP32")
    inp.set_shared_memory("in", MLP_IN)
    out = mod.InferRequestedOutput("output")
    out.set_shared_memory("out", MLP_OUT, offset=100)
    result = client.infer("mlp", [inp], outputs=[out])

    got = shm.get_contents_as_numpy(out_handle, np.float32, [1, 10], offset=100)
    np.testing.assert_array_equal(got, expected)
    answered = result.get_output("output")
    if protocol == "http":
        # As Triton: no data and no parameters (Triton's C++ client, perf_analyzer's, reads
        # an output's parameters as binary data's).
        assert answered == {"name": "output", "datatype": "FP32", "shape": [1, 10]}
    else:
        params = answered.parameters
        assert params["shared_memory_region"].string_param == "out"
        assert params["shared_memory_byte_size"].int64_param == MLP_OUT
        assert params["shared_memory_offset"].int64_param == 100
        assert result.get_response().raw_output_contents == [b""]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bytes_tensors_in_shared_memory_use_tritons_length_prefixed_layout(
    shm_server: RunningServer, regions: Regions, protocol: str
) -> None:
    mod: Any = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(shm_server.http if protocol == "http" else shm_server.grpc)
    text = np.array([[b"a", b"", "é".encode()], [b"longer text", b"x" * 300, b"z"]], dtype=object)
    serialized = serialize_byte_tensor(text)
    size = len(serialized.item())
    in_key, _ = regions.create("text", size, serialized)
    out_key, out_handle = regions.create("echo", 1024)
    client.register_system_shared_memory("text", in_key, size)
    client.register_system_shared_memory("echo", out_key, 1024)
    inp = mod.InferInput("text", [2, 3], "BYTES")
    inp.set_shared_memory("text", size)
    out = mod.InferRequestedOutput("echo")
    out.set_shared_memory("echo", 1024)
    client.infer("strings", [inp], outputs=[out])
    got = shm.get_contents_as_numpy(out_handle, np.object_, [2, 3])
    assert got.tolist() == text.tolist()


def test_grpc_mixes_an_input_in_shared_memory_with_raw_contents(
    shm_server: RunningServer, regions: Regions
) -> None:
    client = grpcclient.InferenceServerClient(shm_server.grpc)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    y = np.full((2, 4), 10, dtype=np.float32)
    key, _ = regions.create("y", 32, y)
    client.register_system_shared_memory("y", key, 32)
    in_x = grpcclient.InferInput("x", [2, 4], "FP32")
    in_x.set_data_from_numpy(x)
    in_y = grpcclient.InferInput("y", [2, 4], "FP32")
    in_y.set_shared_memory("y", 32)
    result = client.infer("add", [in_y, in_x])
    np.testing.assert_array_equal(result.as_numpy("z"), x + y)


def test_outputs_in_shared_memory_and_inline_in_one_http_response(
    shm_server: RunningServer, regions: Regions
) -> None:
    """A binary output after one in shared memory keeps its place in the body."""
    x = np.ones((1, 4), dtype=np.float32)
    key, handle = regions.create("z", 16)
    in_key, _ = regions.create("xy", 16, x)
    client = httpclient.InferenceServerClient(shm_server.http)
    client.register_system_shared_memory("z", key, 16)
    client.register_system_shared_memory("xy", in_key, 16)
    inputs = []
    for name in "xy":
        inp = httpclient.InferInput(name, [1, 4], "FP32")
        inp.set_shared_memory("xy", 16)
        inputs.append(inp)
    out = httpclient.InferRequestedOutput("z")
    out.set_shared_memory("z", 16)
    client.infer("add", inputs, outputs=[out])
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [1, 4]), x + x)


# ---------------------------------------------------------------------- control
def test_status_lists_regions_and_unregister_releases_them(
    shm_server: RunningServer, regions: Regions
) -> None:
    http = httpclient.InferenceServerClient(shm_server.http)
    rpc = grpcclient.InferenceServerClient(shm_server.grpc)
    key_a, _ = regions.create("a", 64)
    key_b, _ = regions.create("b", 64)
    http.register_system_shared_memory("a", key_a, 32, offset=16)
    rpc.register_system_shared_memory("b", key_b, 64)
    status = {r["name"]: r for r in http.get_system_shared_memory_status()}
    assert status == {
        "a": {"name": "a", "key": key_a, "offset": 16, "byte_size": 32},
        "b": {"name": "b", "key": key_b, "offset": 0, "byte_size": 64},
    }
    assert http.get_system_shared_memory_status("a") == [status["a"]]
    grpc_status = rpc.get_system_shared_memory_status(as_json=True)["regions"]
    assert grpc_status["b"] == {"name": "b", "key": key_b, "byte_size": "64"}
    rpc.unregister_system_shared_memory("a")
    assert [r["name"] for r in http.get_system_shared_memory_status()] == ["b"]
    with pytest.raises(InferenceServerException, match="no system shared memory region 'a'"):
        http.get_system_shared_memory_status("a")
    http.unregister_system_shared_memory("never-registered")  # no error, as Triton
    http.unregister_system_shared_memory()
    assert http.get_system_shared_memory_status() == []
    assert rpc.get_system_shared_memory_status(as_json=True) == {}


def test_registering_a_name_twice_is_an_error(shm_server: RunningServer, regions: Regions) -> None:
    key, _ = regions.create("twice", 64)
    http = httpclient.InferenceServerClient(shm_server.http)
    http.register_system_shared_memory("twice", key, 64)
    with pytest.raises(InferenceServerException, match="already registered") as err:
        http.register_system_shared_memory("twice", key, 64)
    assert err.value.status() == "400"
    with pytest.raises(InferenceServerException, match="already registered") as gerr:
        grpcclient.InferenceServerClient(shm_server.grpc).register_system_shared_memory(
            "twice", key, 64
        )
    assert gerr.value.status() == "StatusCode.ALREADY_EXISTS"


def test_keys_outside_dev_shm_and_the_servers_own_segments_are_refused(
    shm_server: RunningServer, regions: Regions, tmp_path: Path
) -> None:
    link = Path(f"/dev/shm/{PREFIX}_link")
    subdir = Path(f"/dev/shm/{PREFIX}_dir")
    own = Path(f"/dev/shm/rts{os.getpid()}i0in_0123456789ab")  # a python worker's name
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 64)
    link.symlink_to(secret)
    subdir.mkdir()
    own.write_bytes(b"\0" * 64)
    try:
        cases = {
            "../../etc/passwd": "must name a file directly in /dev/shm",
            "/etc/passwd": "must name a file directly in /dev/shm",
            f"/{PREFIX}_dir/x": "must name a file directly in /dev/shm",
            "/..": "must name a file directly in /dev/shm",
            "": "must name a file directly in /dev/shm",
            f"/{link.name}": "cannot open",  # O_NOFOLLOW: a link is never followed
            f"/{subdir.name}": "cannot open",
            f"/{own.name}": "the server's own segments",
            "/sem.mp-1234": "semaphore",
            f"/{PREFIX}_missing": "cannot open",
        }
        http = httpclient.InferenceServerClient(shm_server.http)
        for key, message in cases.items():
            with pytest.raises(InferenceServerException, match=message) as err:
                http.register_system_shared_memory("bad", key, 8)
            assert err.value.status() == "400", key
        key, _ = regions.create("small", 64)
        with pytest.raises(InferenceServerException, match="beyond the end") as err:
            http.register_system_shared_memory("big", key, 60, offset=8)
        with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT|beyond the end"):
            grpcclient.InferenceServerClient(shm_server.grpc).register_system_shared_memory(
                "big", key, 65
            )
        assert http.get_system_shared_memory_status() == []
    finally:
        link.unlink()
        subdir.rmdir()
        own.unlink()


# ---------------------------------------------------------------------- inference refusals
def _infer_doc(inputs: list[dict[str, Any]], outputs: list[dict[str, Any]] | None = None) -> Any:
    doc: dict[str, Any] = {"inputs": inputs}
    if outputs is not None:
        doc["outputs"] = outputs
    return doc


def _shm_input(region: str, size: int, **extra: Any) -> dict[str, Any]:
    params = {"shared_memory_region": region, "shared_memory_byte_size": size, **extra}
    return {"name": "input", "datatype": "FP32", "shape": [1, 256], "parameters": params}


def test_inference_refusals_name_the_tensor_and_what_was_expected(
    shm_server: RunningServer, regions: Regions
) -> None:
    key, _ = regions.create("r", 2048, _mlp_input())
    http = httpclient.InferenceServerClient(shm_server.http)
    http.register_system_shared_memory("r", key, 2048)
    url = f"{shm_server.base}/v2/models/mlp/infer"
    data = {"name": "input", "datatype": "FP32", "shape": [1, 256], "data": [0.0] * 256}
    out = {"name": "output", "parameters": {"shared_memory_region": "r"}}
    cases: list[tuple[Any, str]] = [
        (_infer_doc([_shm_input("nope", MLP_IN)]), "no system shared memory region 'nope'"),
        (_infer_doc([_shm_input("r", 1000)]), "1000 bytes do not match shape [1, 256] of FP32"),
        (_infer_doc([_shm_input("r", MLP_IN, shared_memory_offset=1500)]), "beyond the 2048"),
        (_infer_doc([_shm_input("r", -1)]), "shared_memory_byte_size: expected a size"),
        (
            _infer_doc([{**_shm_input("r", MLP_IN), "data": [0.0] * 256}]),
            "has parameters.shared_memory_region and also data",
        ),
        (
            _infer_doc([data], [{**out, "parameters": {**out["parameters"], "binary_data": True}}]),
            "has parameters.shared_memory_region and binary_data",
        ),
        (
            _infer_doc([data], [{"name": "output", "parameters": out["parameters"]}]),
            "needs shared_memory_byte_size",
        ),
        (
            _infer_doc(
                [data],
                [
                    {
                        "name": "output",
                        "parameters": {**out["parameters"], "shared_memory_byte_size": 8},
                    }
                ],
            ),
            "output 'output': shared_memory_byte_size 8 is too small for the result, 40 bytes",
        ),
    ]
    for doc, message in cases:
        status, answer = post_json(url, doc)
        assert status == 400, (doc, answer)
        assert message in answer["error"], answer
        assert "input" in answer["error"] or "output" in answer["error"]
    rpc = grpcclient.InferenceServerClient(shm_server.grpc)
    inp = grpcclient.InferInput("input", [1, 256], "FP32")
    inp.set_shared_memory("r", 512)
    with pytest.raises(InferenceServerException, match="input 'input'.*512 bytes") as err:
        rpc.infer("mlp", [inp])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    inp.set_shared_memory("gone", MLP_IN)
    with pytest.raises(InferenceServerException, match="no system shared memory region 'gone'"):
        rpc.infer("mlp", [inp])


def test_a_region_whose_file_was_truncated_is_an_error_not_a_crash(
    shm_server: RunningServer, regions: Regions
) -> None:
    key, _ = regions.create("shrinks", MLP_IN, _mlp_input())
    out_key, _ = regions.create("shrinks_out", 64)
    http = httpclient.InferenceServerClient(shm_server.http)
    http.register_system_shared_memory("shrinks", key, MLP_IN)
    http.register_system_shared_memory("shrinks_out", out_key, 64)
    os.truncate(f"/dev/shm{key}", 16)
    os.truncate(f"/dev/shm{out_key}", 0)
    inp = httpclient.InferInput("input", [1, 256], "FP32")
    inp.set_shared_memory("shrinks", MLP_IN)
    with pytest.raises(InferenceServerException, match="now shorter than the region"):
        http.infer("mlp", [inp])
    inline = httpclient.InferInput("input", [1, 256], "FP32")
    inline.set_data_from_numpy(_mlp_input())
    out = httpclient.InferRequestedOutput("output")
    out.set_shared_memory("shrinks_out", MLP_OUT)
    with pytest.raises(InferenceServerException, match="now shorter than the region"):
        http.infer("mlp", [inline], outputs=[out])
    assert os.path.getsize(f"/dev/shm{out_key}") == 0  # the file was not grown back
    assert http.is_server_live()


def test_cuda_shared_memory_is_refused_as_by_triton_without_gpus(
    shm_server: RunningServer, server: RunningServer
) -> None:
    for s in (shm_server, server):
        http = httpclient.InferenceServerClient(s.http)
        with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported"):
            http.register_cuda_shared_memory("c", b"\0" * 64, 0, 64)
        rpc = grpcclient.InferenceServerClient(s.grpc)
        with pytest.raises(
            InferenceServerException, match="CUDA shared memory is not supported"
        ) as e:
            rpc.register_cuda_shared_memory("c", b"\0" * 64, 0, 64)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert http.get_cuda_shared_memory_status() == []
        http.unregister_cuda_shared_memory()
        rpc.unregister_cuda_shared_memory()


# ---------------------------------------------------------------------- off by default
def test_shared_memory_is_off_by_default_and_says_how_to_enable_it(server: RunningServer) -> None:
    enable = "--shared-memory system"
    http = httpclient.InferenceServerClient(server.http)
    for call in (
        lambda: http.register_system_shared_memory("r", "/x", 8),
        lambda: http.get_system_shared_memory_status(),
        lambda: http.unregister_system_shared_memory(),
    ):
        with pytest.raises(InferenceServerException, match=enable) as err:
            call()
        assert err.value.status() == "400"
    rpc = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException, match=enable) as gerr:
        rpc.register_system_shared_memory("r", "/x", 8)
    assert gerr.value.status() == "StatusCode.FAILED_PRECONDITION"
    url = f"{server.base}/v2/models/mlp/infer"
    status, answer = post_json(url, _infer_doc([_shm_input("r", MLP_IN)]))
    assert status == 400 and enable in answer["error"] and "input 'input'" in answer["error"]
    # An output asked in shared memory is refused, never answered inline.
    data = {"name": "input", "datatype": "FP32", "shape": [1, 256], "data": [0.0] * 256}
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 40}
    status, answer = post_json(url, _infer_doc([data], [{"name": "output", "parameters": params}]))
    assert status == 400 and enable in answer["error"] and "output 'output'" in answer["error"]
    inp = grpcclient.InferInput("input", [1, 256], "FP32")
    inp.set_data_from_numpy(_mlp_input())
    out = grpcclient.InferRequestedOutput("output")
    out.set_shared_memory("r", 40)
    with pytest.raises(InferenceServerException, match=enable) as gerr:
        rpc.infer("mlp", [inp], outputs=[out])
    assert gerr.value.status() == "StatusCode.FAILED_PRECONDITION"


def test_shared_memory_with_several_workers_is_refused_at_start(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [
        sys.executable, "-m", "rtserve.cli", "serve", "--model-repository", str(tmp_path),
        "--http-port", "0", "--grpc-port", "0", "--workers", "2", "--shared-memory", "system",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert result.returncode == 1
    assert "needs --workers 1" in result.stderr


def test_config_file_enables_shared_memory(tmp_path: Path) -> None:
    from rtserve.config import load_server_config
    from rtserve.errors import ConfigError

    path = tmp_path / "server.yaml"
    path.write_text(f"model_repository: {tmp_path}\nshared_memory: system\n")
    assert load_server_config(path).shared_memory == "system"
    assert load_server_config(None, model_repository=tmp_path).shared_memory == "none"
    path.write_text(f"model_repository: {tmp_path}\nshared_memory: cuda\n")
    with pytest.raises(ConfigError, match="shared_memory"):
        load_server_config(path)


# ---------------------------------------------------------------------- the registry alone
def _file(tmp_path: Path, name: str, size: int) -> str:
    (tmp_path / name).write_bytes(bytes(i % 256 for i in range(size)))
    return name


def test_the_number_of_regions_is_capped(tmp_path: Path) -> None:
    regions = SharedMemoryRegions(max_regions=2, directory=str(tmp_path))
    key = _file(tmp_path, "f", 64)
    regions.register("a", key, 0, 8)
    regions.register("b", "/" + key, 8, 8)
    with pytest.raises(InvalidInput, match="2 regions are registered, the limit"):
        regions.register("c", key, 16, 8)
    regions.unregister("a")
    regions.register("c", key, 16, 8)
    regions.close()
    assert regions.status() == []


def test_an_input_in_shared_memory_is_no_larger_than_a_request_body(tmp_path: Path) -> None:
    regions = SharedMemoryRegions(max_input_bytes=16, directory=str(tmp_path))
    regions.register("big", _file(tmp_path, "big", 64), 0, 64)
    params = {"shared_memory_region": "big", "shared_memory_byte_size": 32}
    with pytest.raises(PayloadTooLarge, match="32 bytes exceed the limit of 16 bytes"):
        regions.read_input(params, "FP32", (8,), 8, "input 'x'", 100)
    params["shared_memory_byte_size"] = 16
    got = regions.read_input(params, "UINT8", (16,), 16, "input 'x'", 100)
    assert got.tolist() == list(range(16))


def test_an_output_whose_region_was_unregistered_in_flight_is_an_error(tmp_path: Path) -> None:
    regions = SharedMemoryRegions(directory=str(tmp_path))
    regions.register("o", _file(tmp_path, "o", 64), 0, 64)
    target = regions.output_region(
        {"shared_memory_region": "o", "shared_memory_byte_size": 16}, "output 'y'"
    )
    regions.unregister("o")
    tensor = Tensor("y", "FP32", (4,), np.zeros(4, dtype=np.float32))
    with pytest.raises(InvalidInput, match="output 'y': .* was unregistered while the request ran"):
        regions.write_outputs([RequestedOutput("y", shared_memory=target)], [tensor])


def test_shared_memory_routes_need_a_key_like_other_routes() -> None:
    token = b"k" * 20
    guard = Guard(Auth([Grant("one-model", token, frozenset({"mlp"}), False)]))
    with pytest.raises(Unauthenticated):
        guard.http("/v2/systemsharedmemory/status", {}, "1.2.3.4")
    guard.http("/v2/systemsharedmemory/region/r/register", {b"x-api-key": token}, "1.2.3.4")

    class Context:
        def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
            self.metadata = metadata

        def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
            return self.metadata

        def peer(self) -> str:
            return "ipv4:1.2.3.4:5"

    request = type("R", (), {"name": "region-not-a-model"})()
    with pytest.raises(Unauthenticated):
        guard.grpc("SystemSharedMemoryRegister", request, Context(()))
    # A region's name is not checked as a model name: any valid key may register.
    guard.grpc("SystemSharedMemoryRegister", request, Context((("x-api-key", token.decode()),)))
    with pytest.raises(Forbidden):
        guard.grpc(
            "ModelInfer",
            type("M", (), {"model_name": "other"})(),
            Context((("x-api-key", token.decode()),)),
        )


# ---------------------------------------------------------------------- perf_analyzer
@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs_with_system_shared_memory(
    shm_server: RunningServer, perf_analyzer_env: dict[str, str], protocol: str, tmp_path: Path
) -> None:
    url = shm_server.http if protocol == "http" else shm_server.grpc
    csv = tmp_path / "result.csv"
    args = [
        "-m", "mlp", "-u", url, "-i", protocol, "--shared-memory", "system",
        "--output-shared-memory-size", "1024", "--concurrency-range", "2",
        "--input-data", "random", "--measurement-mode", "count_windows",
        "--measurement-request-count", "200", "--stability-percentage", "999",
        "--max-trials", "3", "-f", str(csv),
    ]  # fmt: skip
    output = run_perf_analyzer(args, perf_analyzer_env)
    assert "error" not in output.lower()
    assert float(csv.read_text().strip().splitlines()[1].split(",")[1]) > 0
    # perf_analyzer unregisters what it registered.
    with urllib.request.urlopen(f"{shm_server.base}/v2/systemsharedmemory/status") as r:
        assert json.loads(r.read()) == []
