"""Wire compatibility of rtserve's grpc_service.proto with Triton's client protos.

Our classes and tritonclient's define the same full names (``inference.ModelInferRequest``
...). Ours live in a private descriptor pool, so both import in one process (checked below
under both protobuf implementations). The schema checks still read tritonclient's side in
a subprocess (``_TRITON_SIDE``), run once, which receives a JSON job on stdin and answers
with JSON on stdout:

* parses each of our serialized messages with tritonclient's class and returns it as
  a dict (``MessageToDict``) plus the number of fields it did not recognise;
* dumps tritonclient's descriptors (fields, enums, service methods, stub paths) so
  every field we declare can be checked against Triton's number/type/label;
* builds ModelInferRequests with tritonclient (by hand, and through its public
  ``InferInput``/``InferRequestedOutput`` API) for the reverse direction.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf import unknown_fields
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

try:
    from rtserve.protocol import grpc_service_pb2 as pb
    from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc
except ModuleNotFoundError:  # rtserve not installed (no `pip install -e .` yet): use src/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from rtserve.protocol import grpc_service_pb2 as pb
    from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc

SERVICE = "inference.GRPCInferenceService"
RPCS = {
    # name: (request streaming, response streaming)
    "ServerLive": (False, False),
    "ServerReady": (False, False),
    "ModelReady": (False, False),
    "ServerMetadata": (False, False),
    "ModelMetadata": (False, False),
    "ModelInfer": (False, False),
    "ModelStreamInfer": (True, True),
    "ModelConfig": (False, False),
    "ModelStatistics": (False, False),
    "RepositoryIndex": (False, False),
    "RepositoryModelLoad": (False, False),
    "RepositoryModelUnload": (False, False),
    "SystemSharedMemoryStatus": (False, False),
    "SystemSharedMemoryRegister": (False, False),
    "SystemSharedMemoryUnregister": (False, False),
    "CudaSharedMemoryStatus": (False, False),
    "CudaSharedMemoryRegister": (False, False),
    "CudaSharedMemoryUnregister": (False, False),
}

_TRITON_SIDE = r"""
import base64, json, sys

import numpy as np
from google.protobuf import descriptor as _d
from google.protobuf import unknown_fields
from google.protobuf.json_format import MessageToDict

import tritonclient.grpc as grpcclient
from tritonclient.grpc import _utils, model_config_pb2, service_pb2, service_pb2_grpc

job = json.load(sys.stdin)
pool = service_pb2.DESCRIPTOR.pool


def to_dict(msg):
    return MessageToDict(msg, preserving_proto_field_name=True)


def count_unknown(msg):
    n = len(unknown_fields.UnknownFieldSet(msg))
    for field, value in msg.ListFields():
        if field.type != _d.FieldDescriptor.TYPE_MESSAGE:
            continue
        if field.message_type.GetOptions().map_entry:
            vals = value.values() if field.message_type.fields_by_name["value"].message_type else []
        elif field.label == _d.FieldDescriptor.LABEL_REPEATED:
            vals = value
        else:
            vals = [value]
        n += sum(count_unknown(v) for v in vals)
    return n


out = {"parsed": {}, "messages": {}, "enums": {}, "methods": {}, "stub_paths": {}, "built": {}}

for key, (type_name, data) in job["parse"].items():
    msg = getattr(service_pb2, type_name).FromString(base64.b64decode(data))
    out["parsed"][key] = {"dict": to_dict(msg), "unknown": count_unknown(msg)}

for full_name in job["messages"]:
    try:
        d = pool.FindMessageTypeByName(full_name)
    except KeyError:
        out["messages"][full_name] = None
        continue
    out["messages"][full_name] = {
        f.name: [
            f.number,
            f.type,
            f.label,
            (f.message_type or f.enum_type).full_name if (f.message_type or f.enum_type) else "",
            f.containing_oneof.name if f.containing_oneof else "",
        ]
        for f in d.fields
    }

for full_name in job["enums"]:
    try:
        e = pool.FindEnumTypeByName(full_name)
    except KeyError:
        out["enums"][full_name] = None
        continue
    out["enums"][full_name] = {v.name: v.number for v in e.values}

svc = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
for m in svc.methods:
    out["methods"][m.name] = [
        m.input_type.full_name,
        m.output_type.full_name,
        m.client_streaming,
        m.server_streaming,
    ]


class RecordingChannel:
    def _record(kind):
        def method(self, path, *args, **kwargs):
            out["stub_paths"][path.rsplit("/", 1)[1]] = [path, kind]
        return method

    unary_unary = _record("unary_unary")
    unary_stream = _record("unary_stream")
    stream_unary = _record("stream_unary")
    stream_stream = _record("stream_stream")


service_pb2_grpc.GRPCInferenceServiceStub(RecordingChannel())

# Reverse direction 1: a request built field by field with tritonclient's classes.
req = service_pb2.ModelInferRequest(model_name="m", model_version="7", id="req-9")
req.parameters["b"].bool_param = True
req.parameters["i"].int64_param = -(2**40)
req.parameters["s"].string_param = "text"
req.parameters["d"].double_param = 0.375
req.parameters["u"].uint64_param = 2**63 + 5
t = req.inputs.add(name="IN0", datatype="FP32", shape=[2, 3])
t.parameters["shm"].string_param = "region"
t.contents.fp32_contents.extend([1.5, -2.25, 0.0, 3.0, 4.5, -1.0])
t = req.inputs.add(name="IN1", datatype="BYTES", shape=[2])
t.contents.bytes_contents.extend([b"ab", b"\x00\xff"])
o = req.outputs.add(name="OUT0")
o.parameters["classification"].int64_param = 3
req.raw_input_contents.append(b"\x01\x02\x03\x04")
out["built"]["manual"] = [base64.b64encode(req.SerializeToString()).decode(), to_dict(req)]

# Reverse direction 2: what tritonclient's InferenceServerClient.infer() would send.
in0 = grpcclient.InferInput("INPUT0", [2, 2], "FP32")
in0.set_data_from_numpy(np.array([[1, 2], [3, 4]], dtype=np.float32))
in1 = grpcclient.InferInput("INPUT1", [2], "BYTES")
in1.set_data_from_numpy(np.array([b"hello", b"w"], dtype=np.object_))
out0 = grpcclient.InferRequestedOutput("OUTPUT0", class_count=2)
req = _utils._get_inference_request(
    model_name="simple",
    inputs=[in0, in1],
    model_version="1",
    request_id="abc",
    outputs=[out0],
    sequence_id=42,
    sequence_start=True,
    sequence_end=False,
    priority=3,
    timeout=1000,
    parameters={"p_str": "x", "p_bool": True, "p_int": 5, "p_float": 0.5},
)
out["built"]["client_api"] = [base64.b64encode(req.SerializeToString()).decode(), to_dict(req)]

json.dump(out, sys.stdout)
"""


# ---------------------------------------------------------------------------
# Messages built with our classes
# ---------------------------------------------------------------------------


def _param(**kw: Any) -> pb.InferParameter:
    return pb.InferParameter(**kw)


def _all_params() -> dict[str, pb.InferParameter]:
    return {
        "b": _param(bool_param=True),
        "i": _param(int64_param=-(2**40)),
        "s": _param(string_param="text"),
        "d": _param(double_param=0.375),
        "u": _param(uint64_param=2**63 + 5),
    }


def _contents_inputs() -> list[pb.ModelInferRequest.InferInputTensor]:
    # One input per typed contents field, with a matching V2 datatype.
    table: list[tuple[str, str, list[Any]]] = [
        ("BOOL", "bool_contents", [True, False, True]),
        ("INT32", "int_contents", [-(2**31), 0, 2**31 - 1]),
        ("INT64", "int64_contents", [-(2**63), 1, 2**63 - 1]),
        ("UINT32", "uint_contents", [0, 7, 2**32 - 1]),
        ("UINT64", "uint64_contents", [0, 8, 2**64 - 1]),
        ("FP32", "fp32_contents", [1.5, -2.25, 1e-3]),
        ("FP64", "fp64_contents", [0.1, -1e300, 2.5]),
        ("BYTES", "bytes_contents", [b"", b"\x00\x01", b"abc"]),
    ]
    tensors = []
    for i, (datatype, field, values) in enumerate(table):
        t = pb.ModelInferRequest.InferInputTensor(name=f"C{i}", datatype=datatype, shape=[1, 3])
        getattr(t.contents, field).extend(values)
        tensors.append(t)
    return tensors


def _infer_request() -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="resnet", model_version="3", id="req-1")
    for k, v in _all_params().items():
        req.parameters[k].CopyFrom(v)
    req.inputs.extend(_contents_inputs())
    raw = req.inputs.add(name="RAW", datatype="FP16", shape=[2, 2])
    raw.parameters["binary_data_size"].int64_param = 8
    req.outputs.add(name="OUT0").parameters["classification"].int64_param = 5
    req.outputs.add(name="OUT1")
    req.raw_input_contents.extend([b"\x00\x3c" * 4, b"", b"\xff" * 17])
    return req


def _infer_response() -> pb.ModelInferResponse:
    resp = pb.ModelInferResponse(model_name="resnet", model_version="3", id="req-1")
    for k, v in _all_params().items():
        resp.parameters[k].CopyFrom(v)
    out = resp.outputs.add(name="PROBS", datatype="FP32", shape=[1, 1000])
    out.parameters["binary_data_size"].int64_param = 4000
    typed = resp.outputs.add(name="LABEL", datatype="INT64", shape=[1])
    typed.contents.int64_contents.append(281)
    resp.raw_output_contents.append(bytes(range(256)) * 4)
    return resp


def _stream_responses() -> list[pb.ModelStreamInferResponse]:
    return [
        pb.ModelStreamInferResponse(infer_response=_infer_response()),
        pb.ModelStreamInferResponse(error_message="model 'x' is not ready"),
    ]


def _metadata_response() -> pb.ModelMetadataResponse:
    tm = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name="resnet",
        versions=["1", "3"],
        platform="onnxruntime_onnx",
        inputs=[tm(name="input", datatype="FP32", shape=[-1, 3, 224, 224])],
        outputs=[
            tm(name="probs", datatype="FP32", shape=[-1, 1000]),
            tm(name="label", datatype="BYTES", shape=[-1, 1]),
        ],
    )


def _model_config(policy: str) -> pb.ModelConfigResponse:
    cfg = pb.ModelConfig(
        name="resnet",
        platform="onnxruntime_onnx",
        backend="onnxruntime",
        max_batch_size=32,
        input=[
            pb.ModelInput(
                name="input",
                data_type=pb.TYPE_FP32,
                format=pb.ModelInput.FORMAT_NCHW,
                dims=[3, -1, -1],
                reshape=pb.ModelTensorReshape(shape=[3, 224, 224]),
                allow_ragged_batch=True,
                optional=True,
            ),
            pb.ModelInput(name="shape", data_type=pb.TYPE_INT64, dims=[2], is_shape_tensor=True),
            pb.ModelInput(name="text", data_type=pb.TYPE_STRING, dims=[1]),
            pb.ModelInput(name="half", data_type=pb.TYPE_BF16, dims=[4]),
        ],
        output=[
            pb.ModelOutput(
                name="probs",
                data_type=pb.TYPE_FP16,
                dims=[1000],
                label_filename="labels.txt",
                reshape=pb.ModelTensorReshape(shape=[1, 1000]),
            ),
            pb.ModelOutput(
                name="out_shape", data_type=pb.TYPE_INT32, dims=[2], is_shape_tensor=True
            ),
        ],
        instance_group=[
            pb.ModelInstanceGroup(
                name="gpu", kind=pb.ModelInstanceGroup.KIND_GPU, count=2, gpus=[0, 1]
            ),
            pb.ModelInstanceGroup(name="cpu", kind=pb.ModelInstanceGroup.KIND_CPU, count=4),
            pb.ModelInstanceGroup(name="model", kind=pb.ModelInstanceGroup.KIND_MODEL, count=1),
        ],
        dynamic_batching=pb.ModelDynamicBatching(
            preferred_batch_size=[8, 16],
            max_queue_delay_microseconds=500,
            preserve_ordering=True,
            priority_levels=3,
            default_priority_level=2,
            default_queue_policy=pb.ModelQueuePolicy(
                timeout_action=pb.ModelQueuePolicy.DELAY,
                default_timeout_microseconds=100_000,
                allow_timeout_override=True,
                max_queue_size=64,
            ),
        ),
        parameters={"slo_p99_ms": pb.ModelParameter(string_value="50")},
    )
    if policy == "latest":
        cfg.version_policy.latest.num_versions = 2
    elif policy == "all":
        cfg.version_policy.all.SetInParent()
    else:
        cfg.version_policy.specific.versions.extend([1, 3])
    return pb.ModelConfigResponse(config=cfg)


def _dur(count: int, ns: int) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=count, ns=ns)


def _statistics_response() -> pb.ModelStatisticsResponse:
    stats = pb.ModelStatistics(
        name="resnet",
        version="3",
        last_inference=1_700_000_000_123,
        inference_count=640,
        execution_count=20,
        inference_stats=pb.InferStatistics(
            success=_dur(20, 9_000_000),
            fail=_dur(1, 10_000),
            queue=_dur(20, 300_000),
            compute_input=_dur(20, 400_000),
            compute_infer=_dur(20, 7_000_000),
            compute_output=_dur(20, 500_000),
            cache_hit=_dur(3, 30_000),
            cache_miss=_dur(17, 70_000),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=32,
                compute_input=_dur(20, 400_000),
                compute_infer=_dur(20, 7_000_000),
                compute_output=_dur(20, 500_000),
            )
        ],
        memory_usage=[pb.MemoryUsage(type="GPU", id=1, byte_size=2**33)],
    )
    stats.response_stats["0"].CopyFrom(
        pb.InferResponseStatistics(
            compute_infer=_dur(5, 50),
            compute_output=_dur(5, 60),
            success=_dur(5, 110),
            fail=_dur(1, 7),
            empty_response=_dur(2, 3),
            cancel=_dur(1, 1),
        )
    )
    return pb.ModelStatisticsResponse(
        model_stats=[stats, pb.ModelStatistics(name="idle", version="1")]
    )


def _cases() -> dict[str, Message]:
    stream_ok, stream_err = _stream_responses()
    return {
        "ModelInferRequest": _infer_request(),
        "ModelInferResponse": _infer_response(),
        "ModelStreamInferResponse/ok": stream_ok,
        "ModelStreamInferResponse/error": stream_err,
        "ModelMetadataResponse": _metadata_response(),
        "ModelConfigResponse/latest": _model_config("latest"),
        "ModelConfigResponse/all": _model_config("all"),
        "ModelConfigResponse/specific": _model_config("specific"),
        "ModelStatisticsResponse": _statistics_response(),
        "ServerMetadataResponse": pb.ServerMetadataResponse(
            name="rtserve",
            version="0.1.0",
            extensions=["model_configuration", "statistics", "binary_tensor_data"],
        ),
        "ServerLiveResponse": pb.ServerLiveResponse(live=True),
        "ServerReadyResponse": pb.ServerReadyResponse(ready=True),
        "ModelReadyRequest": pb.ModelReadyRequest(name="resnet", version="3"),
        "ModelReadyResponse": pb.ModelReadyResponse(ready=True),
        "ModelMetadataRequest": pb.ModelMetadataRequest(name="resnet", version="3"),
        "ModelConfigRequest": pb.ModelConfigRequest(name="resnet", version="3"),
        "ModelStatisticsRequest": pb.ModelStatisticsRequest(name="resnet", version="3"),
        "RepositoryIndexRequest": pb.RepositoryIndexRequest(repository_name="r", ready=True),
        "RepositoryIndexResponse": pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(
                    name="resnet", version="3", state="READY", reason="ok"
                ),
                pb.RepositoryIndexResponse.ModelIndex(
                    name="bert", version="1", state="UNAVAILABLE", reason="load failed"
                ),
            ]
        ),
        "SystemSharedMemoryStatusRequest": pb.SystemSharedMemoryStatusRequest(name="in0"),
        "SystemSharedMemoryStatusResponse": pb.SystemSharedMemoryStatusResponse(
            regions={
                "in0": pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name="in0", key="/input0", offset=16, byte_size=1024
                )
            }
        ),
        "SystemSharedMemoryRegisterRequest": pb.SystemSharedMemoryRegisterRequest(
            name="in0", key="/input0", offset=16, byte_size=1024
        ),
        "SystemSharedMemoryUnregisterRequest": pb.SystemSharedMemoryUnregisterRequest(name="in0"),
        "CudaSharedMemoryStatusRequest": pb.CudaSharedMemoryStatusRequest(name="c0"),
        "CudaSharedMemoryStatusResponse": pb.CudaSharedMemoryStatusResponse(
            regions={
                "c0": pb.CudaSharedMemoryStatusResponse.RegionStatus(
                    name="c0", device_id=1, byte_size=64
                )
            }
        ),
        "CudaSharedMemoryRegisterRequest": pb.CudaSharedMemoryRegisterRequest(
            name="c0", raw_handle=b"\x01" * 64, device_id=1, byte_size=64
        ),
        "CudaSharedMemoryUnregisterRequest": pb.CudaSharedMemoryUnregisterRequest(name="c0"),
    }


def _to_dict(msg: Message) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True)


# ---------------------------------------------------------------------------
# Descriptor helpers
# ---------------------------------------------------------------------------


def _walk_messages(
    descs: Iterator[_descriptor.Descriptor] | list[_descriptor.Descriptor],
) -> Iterator[_descriptor.Descriptor]:
    for d in descs:
        yield d
        yield from _walk_messages(list(d.nested_types))


def _our_messages() -> list[_descriptor.Descriptor]:
    return list(_walk_messages(list(pb.DESCRIPTOR.message_types_by_name.values())))


def _our_enums() -> list[_descriptor.EnumDescriptor]:
    enums = list(pb.DESCRIPTOR.enum_types_by_name.values())
    for d in _our_messages():
        enums.extend(d.enum_types)
    return enums


def _field_signature(f: _descriptor.FieldDescriptor) -> list[Any]:
    ref = f.message_type or f.enum_type
    return [
        f.number,
        f.type,
        f.label,
        ref.full_name if ref else "",
        f.containing_oneof.name if f.containing_oneof else "",
    ]


def _set_fields(msg: Message, seen: set[tuple[str, str]]) -> None:
    """Record (message full name, field name) for every field set anywhere in msg."""
    for field, value in msg.ListFields():
        seen.add((msg.DESCRIPTOR.full_name, field.name))
        if field.type != _descriptor.FieldDescriptor.TYPE_MESSAGE:
            continue
        if field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            seen.add((field.message_type.full_name, "key"))
            seen.add((field.message_type.full_name, "value"))
            children = list(value.values()) if value_field.message_type else []
        elif field.label == _descriptor.FieldDescriptor.LABEL_REPEATED:
            children = list(value)
        else:
            children = [value]
        for child in children:
            _set_fields(child, seen)


def _reachable_fields(root: _descriptor.Descriptor) -> set[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    todo, done = [root], set()
    while todo:
        d = todo.pop()
        if d.full_name in done:
            continue
        done.add(d.full_name)
        for f in d.fields:
            out.add((d.full_name, f.name))
            if f.message_type is not None:
                todo.append(f.message_type)
    return out


# ---------------------------------------------------------------------------
# The tritonclient side, run once per session
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton() -> dict[str, Any]:
    cases = _cases()
    job = {
        "parse": {
            key: [msg.DESCRIPTOR.name, base64.b64encode(msg.SerializeToString()).decode()]
            for key, msg in cases.items()
        },
        "messages": [d.full_name for d in _our_messages()],
        "enums": [e.full_name for e in _our_enums()],
    }
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_SIDE],
        input=json.dumps(job).encode(),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    result: dict[str, Any] = json.loads(proc.stdout)
    result["cases"] = cases
    return result


# ---------------------------------------------------------------------------
# ours -> tritonclient
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(_cases()))
def test_ours_parsed_by_tritonclient(triton: dict[str, Any], key: str) -> None:
    ours = triton["cases"][key]
    parsed = triton["parsed"][key]
    assert parsed["unknown"] == 0, f"tritonclient did not recognise fields of {key}"
    expected = _to_dict(ours)
    assert expected, "test message must not be empty"
    assert parsed["dict"] == expected


def test_every_field_is_exercised(triton: dict[str, Any]) -> None:
    seen: set[tuple[str, str]] = set()
    for msg in triton["cases"].values():
        _set_fields(msg, seen)
    roots = {msg.DESCRIPTOR.full_name: msg.DESCRIPTOR for msg in triton["cases"].values()}
    expected: set[tuple[str, str]] = set()
    for d in roots.values():
        expected |= _reachable_fields(d)
    assert expected - seen == set()


def test_infer_request_values(triton: dict[str, Any]) -> None:
    got = triton["parsed"]["ModelInferRequest"]["dict"]
    # Spot checks in tritonclient's view (64-bit ints and bytes are JSON strings).
    assert got["parameters"]["b"] == {"bool_param": True}
    assert got["parameters"]["i"] == {"int64_param": str(-(2**40))}
    assert got["parameters"]["s"] == {"string_param": "text"}
    assert got["parameters"]["d"] == {"double_param": 0.375}
    assert got["parameters"]["u"] == {"uint64_param": str(2**63 + 5)}
    assert [base64.b64decode(b) for b in got["raw_input_contents"]] == [
        b"\x00\x3c" * 4,
        b"",
        b"\xff" * 17,
    ]
    assert got["inputs"][6]["contents"]["fp64_contents"] == [0.1, -1e300, 2.5]
    assert got["outputs"][0]["parameters"]["classification"] == {"int64_param": "5"}


def test_model_config_enums(triton: dict[str, Any]) -> None:
    cfg = triton["parsed"]["ModelConfigResponse/latest"]["dict"]["config"]
    assert [i["data_type"] for i in cfg["input"]] == [
        "TYPE_FP32",
        "TYPE_INT64",
        "TYPE_STRING",
        "TYPE_BF16",
    ]
    assert cfg["input"][0]["format"] == "FORMAT_NCHW"
    assert [o["data_type"] for o in cfg["output"]] == ["TYPE_FP16", "TYPE_INT32"]
    assert [g["kind"] for g in cfg["instance_group"]] == ["KIND_GPU", "KIND_CPU", "KIND_MODEL"]
    assert cfg["max_batch_size"] == 32
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == "500"
    assert cfg["dynamic_batching"]["default_queue_policy"]["timeout_action"] == "DELAY"
    assert cfg["dynamic_batching"]["priority_levels"] == "3"  # uint64: a JSON string
    assert cfg["dynamic_batching"]["default_priority_level"] == "2"
    assert cfg["parameters"] == {"slo_p99_ms": {"string_value": "50"}}


# ---------------------------------------------------------------------------
# tritonclient -> ours
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["manual", "client_api"])
def test_tritonclient_request_parsed_by_ours(triton: dict[str, Any], key: str) -> None:
    data_b64, triton_dict = triton["built"][key]
    ours = pb.ModelInferRequest.FromString(base64.b64decode(data_b64))
    assert len(unknown_fields.UnknownFieldSet(ours)) == 0
    assert _to_dict(ours) == triton_dict
    # Re-serialising with our classes gives back the same bytes.
    again = pb.ModelInferRequest.FromString(ours.SerializeToString())
    assert again == ours


def test_tritonclient_manual_request_values(triton: dict[str, Any]) -> None:
    req = pb.ModelInferRequest.FromString(base64.b64decode(triton["built"]["manual"][0]))
    assert (req.model_name, req.model_version, req.id) == ("m", "7", "req-9")
    p = req.parameters
    assert p["b"].WhichOneof("parameter_choice") == "bool_param" and p["b"].bool_param is True
    assert p["i"].int64_param == -(2**40)
    assert p["s"].string_param == "text"
    assert p["d"].double_param == 0.375
    assert p["u"].uint64_param == 2**63 + 5
    assert req.inputs[0].name == "IN0" and req.inputs[0].datatype == "FP32"
    assert list(req.inputs[0].shape) == [2, 3]
    assert req.inputs[0].parameters["shm"].string_param == "region"
    assert list(req.inputs[0].contents.fp32_contents) == [1.5, -2.25, 0.0, 3.0, 4.5, -1.0]
    assert list(req.inputs[1].contents.bytes_contents) == [b"ab", b"\x00\xff"]
    assert req.outputs[0].name == "OUT0"
    assert req.outputs[0].parameters["classification"].int64_param == 3
    assert list(req.raw_input_contents) == [b"\x01\x02\x03\x04"]


def test_tritonclient_api_request_values(triton: dict[str, Any]) -> None:
    req = pb.ModelInferRequest.FromString(base64.b64decode(triton["built"]["client_api"][0]))
    assert (req.model_name, req.model_version, req.id) == ("simple", "1", "abc")
    assert [(t.name, t.datatype, list(t.shape)) for t in req.inputs] == [
        ("INPUT0", "FP32", [2, 2]),
        ("INPUT1", "BYTES", [2]),
    ]
    assert req.raw_input_contents[0] == struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    # BYTES elements: 4-byte little-endian length prefix + payload.
    assert req.raw_input_contents[1] == b"\x05\x00\x00\x00hello\x01\x00\x00\x00w"
    p = req.parameters
    assert p["sequence_id"].int64_param == 42
    assert p["sequence_start"].bool_param is True
    assert p["sequence_end"].WhichOneof("parameter_choice") == "bool_param"
    assert p["priority"].uint64_param == 3
    assert p["timeout"].int64_param == 1000
    assert p["p_str"].string_param == "x"
    assert p["p_bool"].bool_param is True
    assert p["p_int"].int64_param == 5
    assert p["p_float"].double_param == 0.5
    assert req.outputs[0].name == "OUTPUT0"
    assert req.outputs[0].parameters["classification"].int64_param == 2


# ---------------------------------------------------------------------------
# Schema: every field/enum/RPC we declare matches Triton's
# ---------------------------------------------------------------------------


def test_field_numbers_and_types_match_triton(triton: dict[str, Any]) -> None:
    problems = []
    for d in _our_messages():
        theirs = triton["messages"][d.full_name]
        if theirs is None:
            problems.append(f"{d.full_name}: not defined by Triton")
            continue
        for f in d.fields:
            mine = _field_signature(f)
            if theirs.get(f.name) != mine:
                problems.append(f"{d.full_name}.{f.name}: ours {mine} theirs {theirs.get(f.name)}")
    assert problems == []


def test_enums_match_triton(triton: dict[str, Any]) -> None:
    for e in _our_enums():
        theirs = triton["enums"][e.full_name]
        assert theirs is not None, e.full_name
        mine = {v.name: v.number for v in e.values}
        assert {k: theirs.get(k) for k in mine} == mine, e.full_name
    # DataType is complete, not a subset.
    assert triton["enums"]["inference.DataType"] == {
        v.name: v.number for v in pb.DESCRIPTOR.enum_types_by_name["DataType"].values
    }
    assert pb.TYPE_INVALID == 0 and pb.TYPE_STRING == 13 and pb.TYPE_BF16 == 14


def test_rpcs_match_triton(triton: dict[str, Any]) -> None:
    svc = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert svc.full_name == SERVICE
    assert {m.name for m in svc.methods} == set(RPCS)
    for m in svc.methods:
        mine = [
            m.input_type.full_name,
            m.output_type.full_name,
            m.client_streaming,
            m.server_streaming,
        ]
        assert triton["methods"][m.name] == mine, m.name
        assert (m.client_streaming, m.server_streaming) == RPCS[m.name]
    stream = svc.methods_by_name["ModelStreamInfer"]
    assert stream.input_type.full_name == "inference.ModelInferRequest"
    assert stream.output_type.full_name == "inference.ModelStreamInferResponse"


# ---------------------------------------------------------------------------
# Generated gRPC module: full method paths
# ---------------------------------------------------------------------------


class _RecordingChannel:
    def __init__(self) -> None:
        self.paths: dict[str, tuple[str, str]] = {}

    def _record(self, kind: str, path: str) -> None:
        self.paths[path.rsplit("/", 1)[1]] = (path, kind)

    def unary_unary(self, path: str, *args: Any, **kwargs: Any) -> None:
        self._record("unary_unary", path)

    def unary_stream(self, path: str, *args: Any, **kwargs: Any) -> None:
        self._record("unary_stream", path)

    def stream_unary(self, path: str, *args: Any, **kwargs: Any) -> None:
        self._record("stream_unary", path)

    def stream_stream(self, path: str, *args: Any, **kwargs: Any) -> None:
        self._record("stream_stream", path)


def test_stub_method_paths(triton: dict[str, Any]) -> None:
    channel = _RecordingChannel()
    pb_grpc.GRPCInferenceServiceStub(channel)
    assert set(channel.paths) == set(RPCS)
    for name, (path, kind) in channel.paths.items():
        assert path == f"/{SERVICE}/{name}"
        assert kind == ("stream_stream" if name == "ModelStreamInfer" else "unary_unary")
        # Same path and call kind as tritonclient's own stub.
        assert triton["stub_paths"][name] == [path, kind]
    assert channel.paths["ModelInfer"][0] == "/inference.GRPCInferenceService/ModelInfer"


def test_server_registration_paths() -> None:
    handlers: list[Any] = []
    server = SimpleNamespace(add_generic_rpc_handlers=handlers.extend)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(
        pb_grpc.GRPCInferenceServiceServicer(), server
    )
    assert len(handlers) == 1
    (handler,) = handlers
    for name, (req_stream, resp_stream) in RPCS.items():
        rpc = handler.service(SimpleNamespace(method=f"/{SERVICE}/{name}"))
        assert rpc is not None, name
        assert (rpc.request_streaming, rpc.response_streaming) == (req_stream, resp_stream)
    assert handler.service(SimpleNamespace(method=f"/{SERVICE}/NoSuchRpc")) is None


# ---------------------------------------------------------------------------
# One process: our private pool next to tritonclient's default-pool classes
# ---------------------------------------------------------------------------

_SHARED_PROCESS = r"""
import sys
import warnings

warnings.simplefilter("error")
from google.protobuf import descriptor_pool
from google.protobuf.internal import api_implementation

if sys.argv[1] == "rtserve-first":
    from rtserve.protocol import grpc_service_pb2 as pb
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2 as triton
else:
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2 as triton
    from rtserve.protocol import grpc_service_pb2 as pb

assert api_implementation.Type() == sys.argv[2], api_implementation.Type()
default = descriptor_pool.Default().FindMessageTypeByName("inference.ModelInferRequest")
assert default is triton.ModelInferRequest.DESCRIPTOR, "the default pool must hold Triton's"
assert pb.ModelInferRequest.DESCRIPTOR is not default
assert pb.ModelInferRequest.DESCRIPTOR.file.pool is pb._POOL

ours = pb.ModelInferRequest(model_name="m", id="r")
ours.inputs.add(name="x", datatype="FP32", shape=[1, 2]).parameters["p"].int64_param = 7
theirs = triton.ModelInferRequest.FromString(ours.SerializeToString())
assert theirs.inputs[0].parameters["p"].int64_param == 7
x = grpcclient.InferInput("IN", [2], "BYTES")
back = pb.ModelInferRequest.FromString(
    triton.ModelInferRequest(model_name="t", inputs=[x._get_tensor()]).SerializeToString()
)
assert (back.model_name, back.inputs[0].name, back.inputs[0].datatype) == ("t", "IN", "BYTES")
assert isinstance(back.inputs[0], pb.ModelInferRequest.InferInputTensor)
print("shared", api_implementation.Type(), sys.argv[1])
"""


@pytest.mark.parametrize("implementation", ["upb", "python"])
@pytest.mark.parametrize("order", ["rtserve-first", "tritonclient-first"])
def test_rtserve_and_tritonclient_import_in_one_process(order: str, implementation: str) -> None:
    """Also under the pure-Python runtime, where protoc's own builder would register our
    classes in the default pool and tritonclient's import would fail on the clash."""
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": implementation}
    proc = subprocess.run(
        [sys.executable, "-c", _SHARED_PROCESS, order, implementation],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().split() == ["shared", implementation, order]


def test_generated_module_builds_classes_without_protoc_builder() -> None:
    """The checked-in module loads on protobuf 4.25 through today's runtimes only if it
    avoids the version-checked code newer protoc emits (see scripts/gen_proto.sh)."""
    source = Path(pb.__file__).read_text()
    assert "runtime_version" not in source
    assert "internal import builder" not in source
    assert "_descriptor_pool.DescriptorPool()" in source
    assert pb.ModelInferRequest.__module__ == pb.__name__
    assert (
        pb.ModelInferRequest.InferInputTensor.__qualname__ == "ModelInferRequest.InferInputTensor"
    )
    assert pb.ModelInput.Format.Name(pb.ModelInput.FORMAT_NCHW) == "FORMAT_NCHW"
    assert pb.DataType.Value("TYPE_FP32") == pb.TYPE_FP32 == 11
