"""Client mistakes get a 4xx (gRPC INVALID_ARGUMENT / NOT_FOUND) naming the problem, and the
server keeps answering valid requests afterwards."""

from __future__ import annotations

import json

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from tests.conftest import RunningServer

GOOD = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def post(
    server: RunningServer, body: bytes | dict, model: str = "scale", headers: dict | None = None
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.base}/v2/models/{model}/infer", content=content, headers=headers or {}
    )


def assert_still_serving(server: RunningServer) -> None:
    r = post(server, GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]


def tensor(**overrides: object) -> dict:
    t: dict = {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
    t.update(overrides)
    return t


CASES = [
    ("malformed-json", b'{"inputs": [', None, 400, "not valid JSON"),
    ("not-an-object", b"[1, 2]", None, 400, "expected a JSON object"),
    ("no-inputs", {"inputs": []}, None, 400, "inputs"),
    ("missing-input", {"inputs": [tensor(name="z")]}, None, 400, "'z'"),
    ("extra-input", {"inputs": [tensor(), tensor(name="extra")]}, None, 400, "'extra'"),
    ("duplicate-input", {"inputs": [tensor(), tensor()]}, None, 400, "more than once"),
    ("wrong-datatype", {"inputs": [tensor(datatype="FP64")]}, None, 400, "datatype FP64 does not match the model's FP32"),
    ("bytes-to-fp32", {"inputs": [tensor(datatype="BYTES", data=["a", "b", "c", "d"])]}, None, 400, "datatype BYTES, but no input of the model is BYTES"),
    ("unknown-datatype", {"inputs": [tensor(datatype="FLOAT")]}, None, 400, "datatype"),
    ("wrong-shape", {"inputs": [tensor(shape=[1, 3], data=[1, 2, 3])]}, None, 400, "shape [1, 3] does not match the model's [-1, 4]"),
    ("shape-data-mismatch", {"inputs": [tensor(shape=[2, 4])]}, None, 400, "has 4 elements, shape [2, 4] needs 8"),
    ("non-numeric-data", {"inputs": [tensor(data=["a", "b", "c", "d"])]}, None, 400, "FP32"),
    ("negative-dim", {"inputs": [tensor(shape=[-1, 4])]}, None, 400, "shape"),
    ("batch-over-max", {"inputs": [tensor(shape=[5, 4], data=[0.0] * 20)]}, None, 400, "exceeds the model's max_batch_size 4"),
    ("unknown-output", {"inputs": [tensor()], "outputs": [{"name": "nope"}]}, None, 400, "no output 'nope'"),
    ("bad-timeout", {"inputs": [tensor()], "parameters": {"timeout": "soon"}}, None, 400, "parameters.timeout"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "headers", "status", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_http_request_is_a_4xx_naming_the_problem(
    server: RunningServer, body: bytes | dict, headers: dict | None, status: int, needle: str
) -> None:
    r = post(server, body, headers=headers)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]
    assert_still_serving(server)


def test_unknown_model_and_version_are_404(server: RunningServer) -> None:
    r = post(server, GOOD, model="no-such-model")
    assert r.status_code == 404 and "unknown model 'no-such-model'" in r.json()["error"]
    r = httpx.post(f"{server.base}/v2/models/scale/versions/9/infer", json=GOOD)
    assert r.status_code == 404 and "unknown version '9'" in r.json()["error"]
    r = httpx.post(f"{server.base}/v2/models/scale/versions/01/infer", json=GOOD)
    assert r.status_code == 200, r.text  # "01" is version 1 (Triton reads versions as integers)
    assert httpx.get(f"{server.base}/v2/models/no-such-model").status_code == 404
    assert_still_serving(server)


def _binary_header(binary_data_size: int) -> bytes:
    """The JSON part of a binary-extension request for one [1, 4] FP32 input."""
    tensor = {"name": "x", "shape": [1, 4], "datatype": "FP32"}
    tensor["parameters"] = {"binary_data_size": binary_data_size}
    return json.dumps({"inputs": [tensor]}).encode()


def test_binary_size_mismatch_is_400(server: RunningServer) -> None:
    header = _binary_header(12)
    body = header + np.zeros(3, np.float32).tobytes()
    r = post(server, body, headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 400
    assert "12 bytes do not match shape [1, 4] of FP32 (16 bytes)" in r.json()["error"]
    # More binary bytes than the header claims.
    header = _binary_header(16)
    r = post(
        server, header + bytes(20), headers={"Inference-Header-Content-Length": str(len(header))}
    )
    assert r.status_code == 400 and "4 bytes after the last input" in r.json()["error"]
    r = post(server, header + bytes(16), headers={"Inference-Header-Content-Length": "99999"})
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"]
    # Both JSON data and binary data for one input.
    doc = {"inputs": [{**tensor(), "parameters": {"binary_data_size": 16}}]}
    header = json.dumps(doc).encode()
    r = post(
        server, header + bytes(16), headers={"Inference-Header-Content-Length": str(len(header))}
    )
    assert r.status_code == 400 and "both 'data' and parameters.binary_data_size" in r.text
    # A header length past the JSON: the JSON part ends in binary bytes.
    r = post(
        server,
        header + np.full(4, 0.5, np.float32).tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header) + 4)},
    )
    assert r.status_code == 400
    assert f"the JSON header (the first {len(header) + 4} bytes" in r.json()["error"]
    assert_still_serving(server)


def test_body_over_the_limit_is_413(server: RunningServer) -> None:
    big = {"inputs": [tensor(shape=[1, 4], data=[1.0] * 4)], "pad": "x" * 1_100_000}
    r = post(server, big)
    assert r.status_code == 413 and "exceeds the limit of 1000000 bytes" in r.json()["error"]
    assert_still_serving(server)


def test_fp16_json_tensor_is_accepted(server: RunningServer) -> None:
    inputs = [
        {"name": f"in_{t}", "shape": [1, 3], "datatype": t, "data": v}
        for t, v in {
            "FP32": [1, 2, 3], "FP16": [0.5, 1.5, 2.5], "FP64": [1, 2, 3], "INT8": [1, 2, 3],
            "INT16": [1, 2, 3], "INT32": [1, 2, 3], "INT64": [1, 2, 3], "UINT8": [1, 2, 3],
            "BOOL": [True, False, True], "BYTES": ["a", "b", "c"],
        }.items()
    ]  # fmt: skip
    r = post(server, {"inputs": inputs, "outputs": [{"name": "out_FP16"}]}, model="dtypes")
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [0.5, 1.5, 2.5]


def test_bytes_that_are_not_utf8_into_an_onnx_string_input_are_a_400(
    server: RunningServer,
) -> None:
    """ONNX Runtime's string tensors take text: raw bytes that are not UTF-8 are the
    client's error (they were a 500 from inside the runtime), and the server keeps serving."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http)
    inputs = []
    for t, arr in {
        "FP32": np.ones((1, 3), np.float32), "FP16": np.ones((1, 3), np.float16),
        "FP64": np.ones((1, 3)), "INT8": np.ones((1, 3), np.int8),
        "INT16": np.ones((1, 3), np.int16), "INT32": np.ones((1, 3), np.int32),
        "INT64": np.ones((1, 3), np.int64), "UINT8": np.ones((1, 3), np.uint8),
        "BOOL": np.ones((1, 3), bool),
        "BYTES": np.array([[b"ok", b"\xff\xfe\x00bin", b""]], dtype=object),
    }.items():  # fmt: skip
        inputs.append(httpclient.InferInput(f"in_{t}", list(arr.shape), t))
        inputs[-1].set_data_from_numpy(arr, binary_data=True)
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        client.infer("dtypes", inputs)
    assert info.value.status() == "400"
    assert "input 'in_BYTES': element 1 is not UTF-8 text" in info.value.message()
    inputs[-1].set_data_from_numpy(np.array([[b"ok", "h\u00e9".encode(), b""]], dtype=object))
    out = client.infer("dtypes", inputs).as_numpy("out_BYTES")
    assert out.tolist() == [[b"ok", "h\u00e9".encode(), b""]]
    assert_still_serving(server)


def _grpc_infer(server: RunningServer, request: pb.ModelInferRequest) -> grpc.RpcError:
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=10)
    return info.value


def _request(
    model: str = "scale", shape: tuple = (1, 4), datatype: str = "FP32", raw: bytes | None = None
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype=datatype, shape=list(shape))
    request.raw_input_contents.append(
        raw if raw is not None else np.zeros(shape, np.float32).tobytes()
    )
    return request


def test_grpc_errors_have_the_right_codes(server: RunningServer) -> None:
    err = _grpc_infer(server, _request(model="nope"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "unknown model 'nope'" in err.details()
    err = _grpc_infer(server, _request(datatype="INT32"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "datatype INT32" in err.details()
    err = _grpc_infer(server, _request(shape=(1, 3)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "shape [1, 3]" in err.details()
    err = _grpc_infer(server, _request(raw=bytes(7)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "7 bytes" in err.details()
    err = _grpc_infer(server, _request(shape=(6, 4)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_batch_size" in err.details()
    both = _request()
    both.inputs[0].contents.fp32_contents.extend([1, 2, 3, 4])
    err = _grpc_infer(server, both)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "both contents and raw_input_contents" in err.details()
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelMetadata(pb.ModelMetadataRequest(name="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        ok = stub.ModelInfer(_request(raw=np.ones((1, 4), np.float32).tobytes()))
        assert np.frombuffer(ok.raw_output_contents[0], np.float32).tolist() == [2, 2, 2, 2]


def test_broken_model_config_names_file_and_field(server: RunningServer) -> None:
    r = post(server, GOOD, model="broken")
    assert r.status_code == 503
    message = r.json()["error"]
    assert "broken/config.yaml" in message
    assert "dynamic_batching.max_queue_size: expected an integer >= 1, got 0" in message
    assert httpx.get(f"{server.base}/v2/models/broken/ready").status_code in (404, 503)
    index = httpx.post(f"{server.base}/v2/repository/index").json()
    assert {"name": "broken", "state": "UNAVAILABLE"}.items() <= next(
        m for m in index if m["name"] == "broken"
    ).items()
    assert_still_serving(server)
