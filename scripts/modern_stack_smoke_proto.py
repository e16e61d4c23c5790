"""Load rtserve's checked-in gRPC code under whatever protobuf runtime is first on sys.path.

scripts/modern_stack_smoke.sh runs this once per protobuf release (oldest supported to
newest) and per implementation (upb, pure Python). Any warning is an error: a runtime that
frowns on old generated code must fail here, not in a user's log.
"""

from __future__ import annotations

import sys
import warnings

warnings.simplefilter("error")

from google.protobuf import __version__ as protobuf_version  # noqa: E402
from google.protobuf import descriptor_pool, json_format  # noqa: E402
from google.protobuf.internal import api_implementation  # noqa: E402

from rtserve.protocol import grpc_service_pb2 as pb  # noqa: E402
from rtserve.protocol import grpc_service_pb2_grpc as pb_grpc  # noqa: E402


def main() -> None:
    expected = sys.argv[1] if len(sys.argv) > 1 else ""
    if expected and not protobuf_version.startswith(expected):
        raise SystemExit(f"FAIL: wanted protobuf {expected}, imported {protobuf_version}")
    # Our descriptors stay out of the default pool (tritonclient defines the same names).
    try:
        descriptor_pool.Default().FindMessageTypeByName("inference.ModelInferRequest")
        raise SystemExit("FAIL: inference.ModelInferRequest leaked into the default pool")
    except KeyError:
        pass

    req = pb.ModelInferRequest(model_name="m", model_version="2", id="r")
    req.parameters["timeout"].int64_param = 1000
    req.parameters["cache"].bool_param = False
    tensor = req.inputs.add(name="x", datatype="FP32", shape=[2, 3])
    tensor.parameters["binary_data_size"].int64_param = 24
    req.raw_input_contents.append(bytes(range(24)))
    again = pb.ModelInferRequest.FromString(req.SerializeToString())
    assert again == req, "round trip changed the request"
    assert again.parameters["timeout"].WhichOneof("parameter_choice") == "int64_param"
    assert json_format.MessageToDict(again)["inputs"][0]["shape"] == ["2", "3"]

    cfg = pb.ModelConfig(name="m", max_batch_size=8)
    cfg.input.add(name="x", data_type=pb.TYPE_FP32, dims=[3])
    cfg.dynamic_batching.max_queue_delay_microseconds = 200
    assert pb.ModelConfig.FromString(cfg.SerializeToString()).input[0].data_type == pb.TYPE_FP32
    assert pb.DataType.Name(pb.TYPE_BF16) == "TYPE_BF16"
    assert hasattr(pb_grpc, "GRPCInferenceServiceStub")
    print(
        f"ok    protobuf {protobuf_version} ({api_implementation.Type()}): rtserve's gRPC code loads and round-trips"
    )


if __name__ == "__main__":
    main()
