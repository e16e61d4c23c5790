"""Hostile inputs to the decoders and the config loader: refused at once, with a 4xx that
names the field or the limit, without allocating what the request claims; valid clients
are still served (real server, real tritonclient)."""

from __future__ import annotations

import gc
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as thttp
from tritonclient.grpc import service_pb2 as tpb
from tritonclient.grpc import service_pb2_grpc as tpb_grpc

from rtserve.config import load_yaml, parse_model_config
from rtserve.errors import ConfigError, InvalidInput, PayloadTooLarge, RTServeError
from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol.grpc_codec import decode_model_infer
from rtserve.protocol.http_codec import decode_infer_request, encode_infer_response
from rtserve.protocol.limits import DecodeLimits
from rtserve.protocol.types import InferRequest, InferResponse, RequestedOutput, Tensor
from tests.conftest import RunningServer, start_server
from tests.models import build_scale

GiB_ELEMENTS = 1 << 30


def body_of(*inputs: dict[str, Any], **extra: Any) -> bytes:
    return orjson.dumps({"inputs": list(inputs), **extra})


def tensor(**overrides: Any) -> dict[str, Any]:
    t: dict[str, Any] = {"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}
    t.update(overrides)
    return t


def measured(fn: Callable[[], Any]) -> tuple[BaseException | None, float, int]:
    """(the exception raised or None, seconds, peak bytes traced) of one call."""
    gc.collect()
    tracemalloc.start()
    start = time.perf_counter()
    error: BaseException | None = None
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - returned for the test to judge
        error = exc
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return error, elapsed, peak


def decode(body: bytes, header_length: int | None = None, **limits: int) -> InferRequest:
    return decode_infer_request(body, header_length, "m", "", DecodeLimits(**limits))


# ---------------------------------------------------------------- allocation before validation
def test_bytes_shape_without_data_is_refused_before_allocating() -> None:
    header = body_of(
        {
            "name": "b",
            "shape": [1, GiB_ELEMENTS],
            "datatype": "BYTES",
            "parameters": {"binary_data_size": 0},
        }
    )
    error, seconds, peak = measured(lambda: decode(header, len(header)))
    assert isinstance(error, PayloadTooLarge) and error.http_status == 413
    assert "input 'b'" in error.message and "max_elements" in error.message
    assert seconds < 0.05 and peak < 1 << 20
    # Under the element limit the framing bounds the count: 4 bytes per element at least.
    small = body_of(
        {
            "name": "b",
            "shape": [1, 1000],
            "datatype": "BYTES",
            "parameters": {"binary_data_size": 8},
        }
    )
    error, seconds, peak = measured(lambda: decode(small + b"\0" * 8, len(small)))
    assert isinstance(error, InvalidInput)
    assert "1000 BYTES elements need at least 4000 bytes" in error.message
    assert peak < 1 << 20


def test_json_bytes_and_numeric_shapes_are_bounded_by_the_data_present() -> None:
    for datatype in ("BYTES", "FP32", "INT64"):
        body = body_of(tensor(name="big", datatype=datatype, shape=[1 << 15], data=["a"]))
        error, _, peak = measured(lambda b=body: decode(b))
        assert isinstance(error, InvalidInput), (datatype, error)
        assert "input 'big'.data" in error.message and "needs 32768" in error.message
        assert peak < 1 << 20


def test_empty_shape_with_huge_other_dimensions_is_400_naming_the_shape() -> None:
    """[0, 2**21, 2**21, 2**21] holds no elements, but numpy cannot shape it: refused by name
    (JSON, binary and gRPC), not a ValueError from numpy."""
    shape = [0, 1 << 21, 1 << 21, 1 << 21]
    for datatype in ("BOOL", "FP32", "BYTES"):
        with pytest.raises(InvalidInput, match=r"^input 'x'\.shape: .*max_elements"):
            decode(body_of(tensor(datatype=datatype, shape=shape, data=[])))
        header = body_of(tensor(datatype=datatype, shape=shape, data=None,
                                parameters={"binary_data_size": 0}))  # fmt: skip
        with pytest.raises(InvalidInput, match=r"^input 'x'\.shape: "):
            decode(header, len(header))
        msg = pb.ModelInferRequest(model_name="m")
        msg.inputs.add(name="x", datatype=datatype, shape=shape)
        msg.raw_input_contents.append(b"")
        with pytest.raises(InvalidInput, match=r"^input 'x'\.shape: "):
            decode_model_infer(msg)
    assert decode(body_of(tensor(shape=[0, 3], data=[]))).inputs[0].data.shape == (0, 3)


def test_ten_million_empty_bytes_elements_are_refused_quickly() -> None:
    header = body_of(
        {
            "name": "b",
            "shape": [10_000_000],
            "datatype": "BYTES",
            "parameters": {"binary_data_size": 40_000_000},
        }
    )
    body = header + bytes(40_000_000)
    error, seconds, peak = measured(lambda: decode(body, len(header)))
    assert isinstance(error, PayloadTooLarge)
    assert "max_bytes_elements" in error.message and "input 'b'" in error.message
    assert seconds < 0.2 and peak < 1 << 20


def test_grpc_bytes_shape_with_empty_raw_contents_is_refused_before_allocating() -> None:
    for raw in ([b""], []):
        msg = pb.ModelInferRequest(model_name="m")
        msg.inputs.add(name="b", datatype="BYTES", shape=[1, GiB_ELEMENTS])
        msg.raw_input_contents.extend(raw)
        error, seconds, peak = measured(lambda m=msg: decode_model_infer(m))
        assert isinstance(error, RTServeError) and 400 <= error.http_status < 500
        assert "input 'b'" in error.message
        assert seconds < 0.05 and peak < 1 << 20
    small = pb.ModelInferRequest(model_name="m")
    small.inputs.add(name="b", datatype="BYTES", shape=[4096])
    small.raw_input_contents.append(b"")
    with pytest.raises(InvalidInput, match="4096 BYTES elements need at least 16384 bytes"):
        decode_model_infer(small)


def test_grpc_decode_error_keeps_no_decoder_frames_alive() -> None:
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="a", datatype="FP32", shape=[4]).contents.fp32_contents.extend([1] * 4)
    msg.inputs.add(name="b", datatype="BYTES", shape=[3])
    msg.raw_input_contents.extend([np.ones(4, np.float32).tobytes(), b"\0\0\0"])
    with pytest.raises(InvalidInput) as info:
        decode_model_infer(msg)
    frames = []
    tb = info.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "_decode" not in frames and "decode_bytes_elements" not in frames
    assert info.value.__context__ is None and info.value.__cause__ is None


# ---------------------------------------------------------------- bounded CPU before rejection
def test_fifty_megabytes_of_nested_lists_are_refused_before_parsing() -> None:
    data = b"[" + b",".join([b"[1]"] * 12_500_000) + b"]"
    body = b'{"inputs":[{"name":"x","shape":[1,3],"datatype":"FP32","data":%s}]}' % data
    error, seconds, _ = measured(lambda: decode(body))
    assert isinstance(error, PayloadTooLarge)
    assert "max_json_containers" in error.message
    assert seconds < 1.0
    deep = b'{"inputs":[{"name":"x","shape":[1,3],"datatype":"FP32","data":%s}]}' % (
        b"[" * 900 + b"]" * 900
    )
    with pytest.raises(InvalidInput, match=r"input 'x'\.data: nested deeper than"):
        decode(deep * 1)


def test_deep_parameters_are_refused() -> None:
    nested: Any = 1
    for _ in range(40):
        nested = [nested]
    with pytest.raises(InvalidInput, match=r"^parameters: nested deeper than 32 levels"):
        decode(body_of(tensor(), parameters={"p": nested}))
    decode(body_of(tensor(), parameters={"p": [[[1]]]}))


def test_large_flat_json_over_the_value_limit_is_refused_before_parsing() -> None:
    body = body_of(tensor(shape=[1, 100_000], data=[0.5] * 100_000))
    with pytest.raises(PayloadTooLarge, match="max_elements"):
        decode(body, max_elements=10_000)
    assert decode(body).inputs[0].data.shape == (1, 100_000)


def test_counting_before_parsing_refuses_exactly_what_a_full_count_refuses() -> None:
    """A header no longer than a limit is not scanned for it (each thing counted is a byte);
    around both thresholds, refusals are exactly those of counting every byte of every
    header over 4 KiB. Commas and brackets inside a string count too (an over-count)."""
    for limits, cases in (
        (DecodeLimits(max_elements=4000, max_json_containers=6000), (3000, 3900, 4990, 5500)),
        (DecodeLimits(max_elements=20000, max_json_containers=5000), (2000, 4200, 22000)),
    ):
        _prescan_matches_a_full_count(limits, cases)


def _prescan_matches_a_full_count(limits: DecodeLimits, comma_counts: tuple[int, ...]) -> None:
    lengths = []
    refused = 0
    for commas in (*comma_counts, 5100, 7000):
        for brackets in (0, 100, 600, 2000, 5200, 6200):
            body = (
                b'{"inputs":[{"name":"x","shape":[1,1],"datatype":"FP32","data":[1]}],'
                b'"parameters":{"s":"%s%s"}}' % (b"," * commas, b"[" * brackets)
            )
            lengths.append(len(body))
            counted = body.count(b"[") + body.count(b"{")
            full = len(body) > 4096 and (
                counted > limits.max_json_containers
                or body.count(b",") > limits.max_elements + counted + 1024
            )
            try:
                decode_infer_request(body, None, "m", "", limits)
            except PayloadTooLarge as exc:
                assert full and "request JSON: more than" in exc.message, exc.message
                refused += 1
            else:
                assert not full, (commas, brackets)
    assert 0 < refused < len(lengths)
    for edge in (limits.max_elements + 1024, limits.max_json_containers):  # scanned past these
        assert any(4096 < n <= edge for n in lengths) and any(edge < n <= 2 * edge for n in lengths)


# ---------------------------------------------------------------- strict parsing
@pytest.mark.parametrize(
    ("datatype", "data", "needle"),
    [
        ("FP32", [1.0, None, 3.0], "data[1]: expected FP32 numbers, got null"),
        ("FP32", [1.0, "0.5", 3.0], 'data[1]: expected FP32 numbers, got "0.5"'),
        ("FP32", [1.0, True, 3.0], "data[1]: expected FP32 numbers, got true"),
        ("FP32", [[1.0, 2.0, False]], "data[2]: expected FP32 numbers, got false"),
        ("FP32", [1.0, 1e39, 3.0], "data[1]: 1e+39 is out of range for FP32"),
        ("FP16", [1.0, 70000, 3.0], "data[1]: 70000 is out of range for FP16"),
        ("FP64", [1.0, {"a": 1}, 3.0], 'data[1]: expected FP64 numbers, got {"a":1}'),
        ("UINT8", [1, 300, 3], "data[1]: 300 is out of range for UINT8 (0 to 255)"),
        ("UINT32", [1, -1, 3], "data[1]: -1 is out of range for UINT32"),
        ("UINT64", [-1, 0, 0], "data[0]: -1 is out of range for UINT64"),
        ("INT8", [1, 2, -129], "data[2]: -129 is out of range for INT8"),
        ("INT32", [1, 2.5, 3], "data[1]: expected INT32 integers, got 2.5"),
        ("INT64", [1, 2, 2**63], "out of range for INT64"),
        ("INT64", [1, True, 3], "data[1]: expected INT64 integers, got true"),
        ("BOOL", [True, 1, False], "data[1]: expected booleans, got 1"),
        ("BYTES", ["a", 1, "c"], "data[1]: BYTES elements must be strings, got 1"),
    ],
)
def test_values_of_the_wrong_type_or_range_are_400_naming_the_input(
    datatype: str, data: list[Any], needle: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        decode(body_of(tensor(name="feat", datatype=datatype, data=data)))
    assert info.value.http_status == 400
    assert info.value.message.startswith("input 'feat'.data")
    assert needle in info.value.message


def test_booleans_hidden_in_a_long_list_are_found() -> None:
    data: list[Any] = [0.25] * 40_000  # beyond one struct chunk
    data[39_999] = True
    with pytest.raises(InvalidInput, match=r"data\[39999\]: expected FP32 numbers, got true"):
        decode(body_of(tensor(shape=[40_000], data=data)))
    data[39_999] = 1.0
    arr = decode(body_of(tensor(shape=[40_000], data=data))).inputs[0].data
    assert arr.dtype == np.float32 and arr[-1] == 1.0 and arr[0] == 0.25


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("BOOL", [True, False, True, True, False, False]),
        ("UINT8", [0, 1, 255, 7, 8, 9]),
        ("UINT16", [0, 1, 65535, 7, 8, 9]),
        ("UINT32", [0, 1, 2**32 - 1, 7, 8, 9]),
        ("UINT64", [0, 1, 2**64 - 1, 7, 8, 9]),
        ("INT8", [-128, 127, 0, 1, -1, 5]),
        ("INT16", [-(2**15), 2**15 - 1, 0, 1, -1, 5]),
        ("INT32", [-(2**31), 2**31 - 1, 0, 1, -1, 5]),
        ("INT64", [-(2**63), 2**63 - 1, 0, 1, -1, 5]),
        ("FP16", [0.0, 1.0, 65504.0, -65504.0, 0.5, 3]),
        ("FP32", [0.0, 1.0, 3.4e38, -3.4e38, 1e-45, 3]),
        ("FP64", [0.0, 1.0, 1.7e308, -1.7e308, 5e-324, 3]),
    ],
)
def test_valid_values_of_every_datatype_decode_exactly_flat_or_nested(
    datatype: str, values: list[Any]
) -> None:
    expected = np.array(values, dtype=np.dtype(_NUMPY[datatype])).reshape(2, 3)
    for data in (values, [values[:3], values[3:]]):
        t = decode(body_of(tensor(datatype=datatype, shape=[2, 3], data=data))).inputs[0]
        assert t.data.dtype == expected.dtype and t.data.shape == (2, 3)
        assert t.data.flags.writeable  # a user's Python model may write into its inputs
        np.testing.assert_array_equal(t.data, expected)


_NUMPY = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
}


def test_grpc_typed_contents_out_of_range_are_refused() -> None:
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="u", datatype="UINT8", shape=[2]).contents.uint_contents.extend([1, 300])
    with pytest.raises(InvalidInput, match=r"input 'u'.contents.uint_contents\[1\]: 300"):
        decode_model_infer(msg)
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="i", datatype="INT16", shape=[2]).contents.int_contents.extend([-7, 9])
    np.testing.assert_array_equal(decode_model_infer(msg).inputs[0].data, [-7, 9])


def test_non_finite_outputs_are_written_as_strings_that_numpy_reads_back() -> None:
    y = np.array([1.5, np.nan, np.inf, -np.inf], dtype=np.float32)
    response = InferResponse("m", "1", [Tensor("y", "FP32", (4,), y)])
    request = InferRequest("m", "", [], [RequestedOutput("y")])
    body, json_length = encode_infer_response(response, request)
    assert json_length is None and b"null" not in body
    data = orjson.loads(body)["outputs"][0]["data"]
    assert data == [1.5, "NaN", "Infinity", "-Infinity"]
    back = np.array(data, dtype=np.float32)  # what tritonclient's as_numpy does
    np.testing.assert_array_equal(back, y)
    # and an FP input takes them back; other strings are still refused
    got = decode(body_of(tensor(datatype="FP32", shape=[4], data=data))).inputs[0].data
    np.testing.assert_array_equal(got, y)
    with pytest.raises(InvalidInput, match="data"):
        decode(body_of(tensor(datatype="FP32", shape=[2], data=[1.0, "nan"])))
    with pytest.raises(InvalidInput, match="data"):
        decode(body_of(tensor(datatype="INT32", shape=[1], data=["NaN"])))


# ---------------------------------------------------------------- bounded error messages
def test_long_names_are_refused_and_cut_in_error_messages() -> None:
    huge = "n" * 100_000
    with pytest.raises(InvalidInput) as info:
        decode(body_of(tensor(name=huge)))
    assert info.value.message == (
        "inputs[0].name: 100000 characters, longer than the limit of 1024"
    )
    with pytest.raises(InvalidInput, match=r"^outputs\[0\].name: 100000 characters"):
        decode(body_of(tensor(), outputs=[{"name": huge}]))
    long = "n" * 1000  # allowed, but shown cut to 100 characters
    with pytest.raises(InvalidInput) as info:
        decode(body_of(tensor(name=long, datatype="FLOAT")))
    assert len(info.value.message) < 400 and "(1000 characters)" in info.value.message
    for field in ("model_name", "model_version"):
        msg = pb.ModelInferRequest(**{field: huge})
        msg.inputs.add(name="x", datatype="FP32", shape=[1]).contents.fp32_contents.append(1)
        with pytest.raises(InvalidInput) as info:
            decode_model_infer(msg)
        assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.message.startswith(f"{field}: 100000 characters")
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name=long, datatype="FLOAT", shape=[1])
    with pytest.raises(InvalidInput) as info:
        decode_model_infer(msg)
    assert len(info.value.message) < 400


def test_malformed_protobuf_is_invalid_argument_with_a_short_message() -> None:
    for junk in (b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\x0f" + b"x" * 100, bytes(range(256))):
        with pytest.raises(InvalidInput) as info:
            decode_model_infer(junk)
        assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid inference.ModelInferRequest" in info.value.message
        assert len(info.value.message) < 300
    good = pb.ModelInferRequest(model_name="m")
    good.inputs.add(name="x", datatype="FP32", shape=[1]).contents.fp32_contents.append(2.0)
    assert decode_model_infer(good.SerializeToString()).inputs[0].data.tolist() == [2.0]


# ---------------------------------------------------------------- config
def test_yaml_alias_bomb_is_refused_quickly_without_the_expansion(tmp_path: Path) -> None:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    bomb = "\n".join(lines) + "\n"
    assert len(bomb.encode()) < 600
    path = tmp_path / "config.yaml"
    path.write_text(bomb)
    error, seconds, peak = measured(lambda: load_yaml(path))
    assert isinstance(error, ConfigError)
    assert "aliases (*name) are not allowed" in str(error) and str(path) in str(error)
    assert "lol" not in str(error).split("\n", 1)[0][:200] or len(str(error)) < 1000
    assert len(str(error)) <= 1000 and seconds < 0.5 and peak < 4 << 20


def test_oversized_config_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    with pytest.raises(ConfigError, match="larger than"):
        load_yaml(path)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("max_batch_size: 99999999999999999999999", "max_batch_size: expected an integer <= "),
        ("instance_count: 100000", "instance_count: expected an integer <= 1024"),
        (
            "dynamic_batching: {max_queue_size: 4294967296}",
            "max_queue_size: expected an integer <=",
        ),
        ("onnxruntime: {intra_op_threads: 70000}", "intra_op_threads: expected an integer <= 1024"),
    ],
)
def test_absurd_integers_are_refused(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        parse_model_config(load_yaml(path), "m", str(path))
    assert needle in str(info.value) and str(path) in str(info.value)
    assert len(str(info.value)) < 300


# ---------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def roomy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Default request limit (64 MiB), so the decoder, not the transport, refuses."""
    root = tmp_path_factory.mktemp("hostile-repo")
    build_scale(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text("max_batch_size: 4\n")
    s = start_server(root, tmp_path_factory.mktemp("hostile-server"))
    yield s
    s.stop()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _valid_latencies(server: RunningServer, stop: threading.Event, out: list[float]) -> None:
    body = body_of(tensor(shape=[1, 4], data=[1, 2, 3, 4]))
    with httpx.Client(base_url=server.base, timeout=10) as client:
        while not stop.is_set():
            start = time.perf_counter()
            r = client.post("/v2/models/scale/infer", content=body)
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4, 6, 8]
            out.append(time.perf_counter() - start)
            time.sleep(0.01)


def test_hostile_http_requests_get_4xx_while_valid_clients_are_served(
    roomy_server: RunningServer,
) -> None:
    base = f"{roomy_server.base}/v2/models/scale/infer"
    bytes_header = body_of(
        {"name": "x", "shape": [1, GiB_ELEMENTS], "datatype": "BYTES",
         "parameters": {"binary_data_size": 0}}
    )  # fmt: skip
    many_header = body_of(
        {"name": "x", "shape": [10_000_000], "datatype": "BYTES",
         "parameters": {"binary_data_size": 40_000_000}}
    )  # fmt: skip
    nested = b'{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[%s]}]}' % (
        b",".join([b"[1]"] * 12_000_000)
    )
    hostile: list[tuple[bytes, dict[str, str], int, str]] = [
        (bytes_header, {"Inference-Header-Content-Length": str(len(bytes_header))}, 413, "max_elements"),
        # The server sizes each model's budget to its signature: this FP32 model accepts
        # far fewer elements (and no BYTES), so the element limit refuses it first.
        (many_header + bytes(40_000_000), {"Inference-Header-Content-Length": str(len(many_header))}, 413, "max_elements"),
        (nested, {}, 413, "max_json_containers"),
        (body_of(tensor(shape=[1, 4], data=[1, None, 3, 4])), {}, 400, "got null"),
        (body_of(tensor(shape=[1, 4], data=[1, "0.5", 3, 4])), {}, 400, 'got "0.5"'),
        (body_of(tensor(shape=[1, 4], data=[1, True, 3, 4])), {}, 400, "got true"),
        (body_of(tensor(shape=[1, 4], data=[1, 1e39, 3, 4])), {}, 400, "out of range for FP32"),
    ]  # fmt: skip
    pid = roomy_server.proc.pid
    latencies: list[float] = []
    stop = threading.Event()
    worker = threading.Thread(target=_valid_latencies, args=(roomy_server, stop, latencies))
    worker.start()
    try:
        time.sleep(0.3)
        baseline = _rss_bytes(pid)
        with httpx.Client(timeout=30) as client:
            for body, headers, status, needle in hostile:
                r = client.post(base, content=body, headers=headers)
                assert r.status_code == status, r.text[:300]
                assert needle in r.json()["error"]
        time.sleep(0.3)
    finally:
        stop.set()
        worker.join(30)
    assert len(latencies) > 10
    assert max(latencies) < 2.0, f"a valid request waited {max(latencies):.2f} s"
    assert _rss_bytes(pid) < baseline + (300 << 20)


def test_hostile_grpc_requests_are_refused_and_memory_is_returned(
    roomy_server: RunningServer,
) -> None:
    pid = roomy_server.proc.pid
    with grpc.insecure_channel(roomy_server.grpc) as channel:
        stub = tpb_grpc.GRPCInferenceServiceStub(channel)
        baseline = _rss_bytes(pid)
        for _ in range(6):
            msg = tpb.ModelInferRequest(model_name="scale")
            msg.inputs.add(name="x", datatype="BYTES", shape=[1, GiB_ELEMENTS])
            msg.raw_input_contents.append(b"")
            start = time.perf_counter()
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(msg, timeout=10)
            assert time.perf_counter() - start < 2.0
            assert info.value.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
            assert "input 'x'" in (info.value.details() or "")
        assert _rss_bytes(pid) < baseline + (100 << 20)
        good = tpb.ModelInferRequest(model_name="scale")
        good.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        good.raw_input_contents.append(struct.pack("<4f", 1, 2, 3, 4))
        reply = stub.ModelInfer(good, timeout=10)
        assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [2, 4, 6, 8]


def test_tritonclient_reads_infinite_outputs_from_json(roomy_server: RunningServer) -> None:
    client = thttp.InferenceServerClient(roomy_server.http)
    x = thttp.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.array([[3e38, -3e38, 1.0, 0.0]], np.float32), binary_data=True)
    out = thttp.InferRequestedOutput("y", binary_data=False)
    result = client.infer("scale", [x], outputs=[out])
    np.testing.assert_array_equal(result.as_numpy("y"), [[np.inf, -np.inf, 2.0, 0.0]])
    client.close()


def test_grpc_long_model_name_and_malformed_message_get_short_answers(
    roomy_server: RunningServer,
) -> None:
    with grpc.insecure_channel(roomy_server.grpc) as channel:
        stub = tpb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(tpb.ModelInferRequest(model_name="n" * 100_000), timeout=10)
        assert info.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
        assert len(info.value.details() or "") < 400
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(info.value.details() or "") < 400


def test_limits_for_a_static_model_refuse_oversized_json_before_parsing() -> None:
    from rtserve.config import TensorSpec
    from rtserve.protocol.limits import limits_for_model

    limits = limits_for_model([TensorSpec("x", "FP32", (256,))], 32)
    assert (limits.max_elements, limits.max_bytes_elements) == (32 * 256, 0)
    dynamic = limits_for_model([TensorSpec("x", "FP32", (-1,))], 32)
    assert dynamic == DecodeLimits()
    body = body_of(tensor(shape=[40, 256], data=[0.5] * (40 * 256)))
    error, seconds, peak = measured(lambda: decode_infer_request(body, None, "m", "", limits))
    assert isinstance(error, PayloadTooLarge) and "max_elements" in error.message
    assert peak < len(body)  # refused before orjson built the list
    ok = body_of(tensor(shape=[32, 256], data=[0.5] * (32 * 256)))
    assert decode_infer_request(ok, None, "m", "", limits).inputs[0].data.shape == (32, 256)


def test_binary_data_flags_must_be_booleans() -> None:
    """`"yes"` was ignored (a JSON answer where the client asked for binary, or the reverse)."""
    body = orjson.dumps({"inputs": [tensor()], "parameters": {"binary_data_output": "yes"}})
    with pytest.raises(InvalidInput, match="parameters.binary_data_output: expected true or false"):
        decode(body)
    body = orjson.dumps(
        {"inputs": [tensor()], "outputs": [{"name": "y", "parameters": {"binary_data": 1}}]}
    )
    with pytest.raises(InvalidInput, match=r"outputs\[0\].parameters.binary_data: expected true"):
        decode(body)
    body = orjson.dumps({"inputs": [tensor()], "parameters": {"binary_data_output": True}})
    assert decode(body).parameters["binary_data_output"] is True
