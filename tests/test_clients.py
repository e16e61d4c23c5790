"""Round trips with Triton's own clients; outputs must equal a direct onnxruntime run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from tests.conftest import RunningServer

TYPES = {
    "FP32": np.float32,
    "FP16": np.float16,
    "FP64": np.float64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "BOOL": np.bool_,
    "BYTES": np.object_,
}


def reference(repo: Path, model: str, feeds: dict[str, np.ndarray], version: str = "1") -> dict:
    session = ort.InferenceSession(str(repo / model / version / "model.onnx"))
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def sample(datatype: str, rng: np.random.Generator, rows: int = 2) -> np.ndarray:
    if datatype == "BYTES":
        return np.array(
            [[f"r{r}c{c}-ü".encode() for c in range(3)] for r in range(rows)], dtype=object
        )
    if datatype == "BOOL":
        return rng.integers(0, 2, size=(rows, 3)).astype(bool)
    if datatype.startswith(("INT", "UINT")):
        return rng.integers(0, 100, size=(rows, 3)).astype(TYPES[datatype])
    return rng.normal(size=(rows, 3)).astype(TYPES[datatype])


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_http_client_matches_onnxruntime(
    server: RunningServer, test_repo: Path, binary: bool
) -> None:
    x = np.random.default_rng(1).random((5, 64), dtype=np.float32)
    client = thttp.InferenceServerClient(server.http)
    inp = thttp.InferInput("pixels", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [
        thttp.InferRequestedOutput(n, binary_data=binary)
        for n in ("logits", "probabilities", "label")
    ]
    result = client.infer("digits", [inp], outputs=outputs)
    want = reference(test_repo, "digits", {"pixels": x})
    np.testing.assert_allclose(result.as_numpy("logits"), want["logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        result.as_numpy("probabilities"), want["probabilities"], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(result.as_numpy("label"), want["label"])


def test_grpc_client_matches_onnxruntime(server: RunningServer, test_repo: Path) -> None:
    x = np.random.default_rng(2).normal(size=(3, 256)).astype(np.float32)
    client = tgrpc.InferenceServerClient(server.grpc)
    inp = tgrpc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("mlp", [inp])
    want = reference(test_repo, "mlp", {"input": x})
    np.testing.assert_allclose(result.as_numpy("output"), want["output"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("datatype", list(TYPES))
@pytest.mark.parametrize("transport", ["http-json", "http-binary", "grpc"])
def test_every_datatype_round_trips(server: RunningServer, datatype: str, transport: str) -> None:
    x = sample(datatype, np.random.default_rng(3))
    name_in, name_out = f"in_{datatype}", f"out_{datatype}"
    feeds = {f"in_{t}": sample(t, np.random.default_rng(3)) for t in TYPES}
    feeds[name_in] = x
    if transport == "grpc":
        gclient = tgrpc.InferenceServerClient(server.grpc)
        ginputs = []
        for name, arr in feeds.items():
            gi = tgrpc.InferInput(name, list(arr.shape), name.removeprefix("in_"))
            gi.set_data_from_numpy(arr)
            ginputs.append(gi)
        got = gclient.infer(
            "dtypes", ginputs, outputs=[tgrpc.InferRequestedOutput(name_out)]
        ).as_numpy(name_out)
    else:
        binary = transport == "http-binary"
        if datatype == "FP16" and not binary:
            pytest.skip("tritonclient sends FP16 only as binary data")
        hclient = thttp.InferenceServerClient(server.http)
        hinputs = []
        for name, arr in feeds.items():
            t = name.removeprefix("in_")
            hi = thttp.InferInput(name, list(arr.shape), t)
            hi.set_data_from_numpy(arr, binary_data=binary or t == "FP16")
            hinputs.append(hi)
        out = thttp.InferRequestedOutput(name_out, binary_data=binary)
        got = hclient.infer("dtypes", hinputs, outputs=[out]).as_numpy(name_out)
    assert got is not None
    assert got.shape == x.shape
    if datatype == "BYTES":
        assert [v if isinstance(v, bytes) else v.encode() for v in got.reshape(-1)] == list(
            x.reshape(-1)
        )
    else:
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got, x)


def test_versions_default_to_latest(server: RunningServer) -> None:
    client = thttp.InferenceServerClient(server.http)
    x = np.ones((1, 4), dtype=np.float32)
    inp = thttp.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    latest = client.infer("scale", [inp])
    assert latest.get_response()["model_version"] == "2"
    np.testing.assert_array_equal(latest.as_numpy("y"), 2 * x)
    v1 = client.infer("scale", [inp], model_version="1")
    np.testing.assert_array_equal(v1.as_numpy("y"), x)
    assert client.is_model_ready("scale", "1") and client.is_model_ready("scale", "2")
    assert sorted(client.get_model_metadata("scale")["versions"]) == ["1", "2"]


def test_health_metadata_and_config_http(server: RunningServer) -> None:
    client = thttp.InferenceServerClient(server.http)
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "rtserve" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("mlp")
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 256]}]
    assert model["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]
    config = client.get_model_config("mlp")
    assert config["max_batch_size"] == 32
    assert config["input"][0] == {"name": "input", "data_type": "TYPE_FP32", "dims": [256]}
    assert not client.is_model_ready("broken")


def test_health_metadata_and_config_grpc(server: RunningServer) -> None:
    client = tgrpc.InferenceServerClient(server.grpc)
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata().name == "rtserve"
    meta = client.get_model_metadata("digits")
    assert [i.name for i in meta.inputs] == ["pixels"]
    assert list(meta.inputs[0].shape) == [-1, 64]
    config = client.get_model_config("digits").config
    assert config.max_batch_size == 64
    assert config.input[0].name == "pixels" and list(config.input[0].dims) == [64]
    assert config.input[0].data_type == 11  # TYPE_FP32
    assert client.is_model_ready("digits")
    pixels = tgrpc.InferInput("pixels", [1, 64], "FP32")
    pixels.set_data_from_numpy(np.zeros((1, 64), np.float32))
    client.infer("digits", [pixels])
    stats = client.get_inference_statistics("digits")
    assert stats.model_stats[0].name == "digits"
    assert stats.model_stats[0].last_inference > 0  # ms since the epoch of the last batch


def test_grpc_trailing_metadata_carries_server_timing(server: RunningServer) -> None:
    # Triton's generated classes (ours would clash with them in one process).
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.grpc) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="scale", model_version="1")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
        response, call = stub.ModelInfer.with_call(request)
    trailing = dict(call.trailing_metadata())
    assert "compute;dur=" in trailing["server-timing"]
    assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [0, 1, 2, 3]


def test_http_response_has_server_timing_and_metrics(server: RunningServer) -> None:
    import httpx

    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    r = httpx.post(f"{server.base}/v2/models/scale/versions/1/infer", json=body)
    assert r.status_code == 200
    assert r.json()["outputs"][0]["data"] == [1.0, 2.0, 3.0, 4.0]
    timing = r.headers["server-timing"]
    assert "queue;dur=" in timing and "compute;dur=" in timing and "total;dur=" in timing
    metrics = httpx.get(f"{server.base}/metrics").text
    assert 'rtserve_requests_total{model="scale",outcome="success",version="1"}' in metrics
    for name in ("rtserve_queue_duration_seconds", "rtserve_compute_duration_seconds",
                 "rtserve_request_duration_seconds", "rtserve_batch_size", "rtserve_queue_depth"):  # fmt: skip
        assert f"{name}" in metrics


def test_gzip_request_body_is_accepted(server: RunningServer) -> None:
    import gzip

    import httpx
    import orjson

    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    r = httpx.post(
        f"{server.base}/v2/models/scale/infer",
        content=gzip.compress(orjson.dumps(body)),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]


def test_grpc_stream_infer(server: RunningServer) -> None:
    import queue

    results: queue.Queue = queue.Queue()
    client = tgrpc.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(5):
            inp = tgrpc.InferInput("x", [1, 4], "FP32")
            inp.set_data_from_numpy(np.full((1, 4), i, np.float32))
            client.async_stream_infer("scale", [inp], model_version="1", request_id=str(i))
        bad = tgrpc.InferInput("x", [1, 3], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
        client.async_stream_infer("scale", [bad], model_version="1", request_id="bad")
        got = [results.get(timeout=10) for _ in range(6)]
    finally:
        client.stop_stream()
    answers = {r.get_response().id: r.as_numpy("y").tolist() for r, e in got if e is None}
    assert answers == {str(i): [[float(i)] * 4] for i in range(5)}
    # one answer a request, flagged final as Triton flags it (clients read until the flag)
    flags = [
        r.get_response().parameters["triton_final_response"].bool_param for r, e in got if e is None
    ]
    assert flags == [True] * 5
    errors = [e for _, e in got if e is not None]
    assert len(errors) == 1 and "shape [1, 3]" in str(errors[0])
