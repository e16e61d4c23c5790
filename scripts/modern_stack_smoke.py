"""Serve the example repository and query it over plain HTTP and grpcio, on today's stacks.

Run by scripts/modern_stack_smoke.sh inside a venv with numpy 2, protobuf 5+ and current
onnx / onnxruntime, where tritonclient (numpy<2) cannot be installed: the clients here are
urllib and grpcio with rtserve's own generated stubs. Every answer is compared with the
same ONNX model run locally through onnxruntime.

    python scripts/modern_stack_smoke.py --repository examples/repository
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import onnxruntime as ort
from google.protobuf import __version__ as protobuf_version

from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc

START_TIMEOUT_S = 90.0
CALL_TIMEOUT_S = 20.0


def check(condition: bool, what: str, detail: object = "") -> None:
    if not condition:
        raise SystemExit(f"FAIL: {what}" + (f" ({detail})" if detail else ""))
    print(f"ok    {what}", flush=True)


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


def start_server(repository: Path, workdir: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    ports_file = workdir / "ports.json"
    rtserve = shutil.which("rtserve", path=str(Path(sys.executable).parent))
    check(rtserve is not None, f"the rtserve command is installed next to {sys.executable}")
    log = (workdir / "server.log").open("wb")
    proc = subprocess.Popen(
        [
            str(rtserve),
            "serve",
            "--model-repository",
            str(repository),
            "--host",
            "127.0.0.1",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--ports-file",
            str(ports_file),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if ports_file.exists() and ports_file.read_text().strip():
            return proc, json.loads(ports_file.read_text())
        time.sleep(0.2)
    code = proc.poll()
    stop_server(proc)
    sys.stdout.write((workdir / "server.log").read_text(errors="replace"))
    if code is not None:
        raise SystemExit(f"FAIL: rtserve exited with code {code} before it was ready")
    raise SystemExit(f"FAIL: rtserve did not become ready within {START_TIMEOUT_S:.0f} s")


def stop_server(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# ---------------------------------------------------------------------------
# Plain HTTP (urllib)
# ---------------------------------------------------------------------------


def http(
    base: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(base + path, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=CALL_TIMEOUT_S) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def http_checks(base: str, repository: Path, mlp: ort.InferenceSession, digits: Any) -> None:
    status, _, _ = http(base, "/v2/health/ready")
    check(status == 200, "HTTP GET /v2/health/ready is 200")

    status, _, body = http(base, "/v2/models/mlp")
    meta = json.loads(body)
    check(
        status == 200
        and meta["inputs"][0]["name"] == "input"
        and meta["inputs"][0]["shape"][-1] == 256,
        "HTTP model metadata of mlp names input [-1, 256]",
    )

    # JSON tensors: two rows of the MLP against onnxruntime run here.
    x = np.random.default_rng(0).random((2, 256), dtype=np.float32)
    request = {
        "inputs": [
            {"name": "input", "shape": [2, 256], "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    status, _, body = http(base, "/v2/models/mlp/infer", json.dumps(request).encode())
    check(status == 200, "HTTP JSON infer on mlp is 200", f"{status}: {body[:300]!r}")
    out = json.loads(body)["outputs"][0]
    got = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    want = mlp.run(None, {"input": x})[0]
    check(
        got.shape == (2, 10) and np.allclose(got, want, rtol=1e-4, atol=1e-5),
        "HTTP JSON mlp outputs equal onnxruntime's",
    )

    # The README's example request.
    example = (repository / "digits" / "example_request.json").read_bytes()
    status, _, body = http(base, "/v2/models/digits/infer", example)
    outputs = {o["name"]: o for o in json.loads(body)["outputs"]} if status == 200 else {}
    check("label" in outputs, "HTTP digits example_request.json answers a label")

    # Binary tensor extension: 64 held-out digits in one request.
    images, labels = digits["x"][:64], digits["y"][:64]
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "pixels",
                    "shape": list(images.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": images.nbytes},
                }
            ],
            "outputs": [{"name": "label"}],
        }
    ).encode()
    status, _, body = http(
        base,
        "/v2/models/digits/infer",
        header + images.tobytes(),
        {
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Type": "application/octet-stream",
        },
    )
    check(status == 200, "HTTP binary infer on digits is 200", f"{status}: {body[:300]!r}")
    predicted = np.asarray(json.loads(body)["outputs"][0]["data"], dtype=np.int64)
    accuracy = float((predicted == labels).mean())
    check(
        accuracy >= 0.9, f"HTTP binary digits accuracy on 64 held-out images {accuracy:.3f} >= 0.9"
    )

    status, _, body = http(base, "/v2/models/nosuchmodel/infer", json.dumps(request).encode())
    check(status == 404, "HTTP infer on an unknown model is 404")
    bad = {
        "inputs": [{"name": "wrong", "shape": [1, 256], "datatype": "FP32", "data": [0.0] * 256}]
    }
    status, _, body = http(base, "/v2/models/mlp/infer", json.dumps(bad).encode())
    check(status == 400 and b"wrong" in body, "HTTP unknown input name is 400 naming it", body)


# ---------------------------------------------------------------------------
# gRPC (grpcio + rtserve's generated stubs)
# ---------------------------------------------------------------------------


def mlp_request(x: np.ndarray, request_id: str = "") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="mlp", id=request_id)
    req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


def output_array(resp: pb.ModelInferResponse, index: int = 0) -> np.ndarray:
    out = resp.outputs[index]
    if out.datatype != "FP32":
        raise SystemExit(f"FAIL: gRPC output {out.name} is {out.datatype}, expected FP32")
    return np.frombuffer(resp.raw_output_contents[index], dtype=np.float32).reshape(list(out.shape))


def grpc_checks(target: str, mlp: ort.InferenceSession) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        check(
            stub.ServerLive(pb.ServerLiveRequest(), timeout=CALL_TIMEOUT_S).live, "gRPC ServerLive"
        )
        check(
            stub.ServerReady(pb.ServerReadyRequest(), timeout=CALL_TIMEOUT_S).ready,
            "gRPC ServerReady",
        )
        meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp"), timeout=CALL_TIMEOUT_S)
        check(
            [(t.name, t.datatype) for t in meta.inputs] == [("input", "FP32")],
            "gRPC ModelMetadata of mlp",
        )
        config = stub.ModelConfig(pb.ModelConfigRequest(name="mlp"), timeout=CALL_TIMEOUT_S).config
        check(config.max_batch_size == 32, "gRPC ModelConfig of mlp: max_batch_size 32")

        x = np.random.default_rng(1).random((4, 256), dtype=np.float32)
        resp = stub.ModelInfer(mlp_request(x, "one"), timeout=CALL_TIMEOUT_S)
        got = output_array(resp)
        want = mlp.run(None, {"input": x})[0]
        check(
            resp.id == "one"
            and got.shape == (4, 10)
            and np.allclose(got, want, rtol=1e-4, atol=1e-5),
            "gRPC ModelInfer mlp outputs equal onnxruntime's",
        )

        rows = [np.random.default_rng(10 + i).random((1, 256), dtype=np.float32) for i in range(3)]

        def stream() -> Iterator[pb.ModelInferRequest]:
            for i, row in enumerate(rows):
                yield mlp_request(row, f"s{i}")

        answers = list(stub.ModelStreamInfer(stream(), timeout=CALL_TIMEOUT_S))
        by_id = {a.infer_response.id: a for a in answers}
        check(
            len(answers) == 3
            and all(not a.error_message for a in answers)
            and all(
                np.allclose(
                    output_array(by_id[f"s{i}"].infer_response),
                    mlp.run(None, {"input": row})[0],
                    atol=1e-5,
                )
                for i, row in enumerate(rows)
            ),
            "gRPC ModelStreamInfer answers 3 requests correctly",
        )

        bad = pb.ModelInferRequest(model_name="mlp")
        bad.inputs.add(name="wrong", datatype="FP32", shape=[1, 256])
        bad.raw_input_contents.append(struct.pack("<256f", *([0.0] * 256)))
        try:
            stub.ModelInfer(bad, timeout=CALL_TIMEOUT_S)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
        check(
            code == grpc.StatusCode.INVALID_ARGUMENT and "wrong" in details,
            "gRPC unknown input name is INVALID_ARGUMENT naming it",
            f"{code}: {details}",
        )
        try:
            stub.ModelInfer(pb.ModelInferRequest(model_name="nosuchmodel"), timeout=CALL_TIMEOUT_S)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
        check(code == grpc.StatusCode.NOT_FOUND, "gRPC unknown model is NOT_FOUND", code)

        again = stub.ModelInfer(mlp_request(x), timeout=CALL_TIMEOUT_S)
        check(
            np.allclose(output_array(again), want, atol=1e-5),
            "gRPC still serves after bad requests",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, default=Path("examples/repository"))
    args = parser.parse_args()
    repository = args.repository.resolve()

    print(
        f"stack: python {sys.version.split()[0]}, numpy {np.__version__}, protobuf {protobuf_version}, "
        f"onnx {onnx.__version__}, onnxruntime {ort.__version__}, grpcio {grpc.__version__}",
        flush=True,
    )
    check(int(np.__version__.split(".")[0]) >= 2, f"numpy {np.__version__} is 2 or later")
    check(int(protobuf_version.split(".")[0]) >= 5, f"protobuf {protobuf_version} is 5 or later")
    model = onnx.load(str(repository / "mlp" / "1" / "model.onnx"))
    onnx.checker.check_model(model)
    check(True, "import onnx works next to rtserve; onnx.checker accepts the mlp")

    mlp = ort.InferenceSession(
        str(repository / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    digits = np.load(repository / "digits" / "test_set.npz")

    with tempfile.TemporaryDirectory(prefix="rtserve-modern-") as tmp:
        started = time.monotonic()
        proc, ports = start_server(repository, Path(tmp))
        print(f"rtserve ready in {time.monotonic() - started:.1f} s: {ports}", flush=True)
        try:
            http_checks(f"http://127.0.0.1:{ports['http_port']}", repository, mlp, digits)
            grpc_checks(f"127.0.0.1:{ports['grpc_port']}", mlp)
        except BaseException:
            stop_server(proc)
            sys.stdout.write((Path(tmp) / "server.log").read_text(errors="replace"))
            raise
        code = stop_server(proc)
        check(code == 0, "rtserve exits 0 on SIGTERM", code)
    print("modern stack smoke: all checks passed", flush=True)


if __name__ == "__main__":
    main()
