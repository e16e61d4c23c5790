#!/usr/bin/env bash
# Regenerate the Python gRPC modules for src/rtserve/protocol/grpc_service.proto.
# -Isrc makes the proto's import path rtserve/protocol/grpc_service.proto, so the
# generated _grpc module imports `from rtserve.protocol import grpc_service_pb2`.
# Needs grpcio-tools==1.62.3 (dev extra) in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" -m grpc_tools.protoc -Isrc --python_out=src --pyi_out=src --grpc_python_out=src src/rtserve/protocol/grpc_service.proto
# Register our descriptors in a private pool instead of protobuf's default one: Triton's
# client libraries define the same message names (package `inference`), and both must be
# importable in one process (a server embedded next to tritonclient, the test suite).
sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/_POOL = _descriptor_pool.DescriptorPool()\nDESCRIPTOR = _POOL.AddSerializedFile(/' src/rtserve/protocol/grpc_service_pb2.py
grep -q "^_POOL = _descriptor_pool.DescriptorPool()" src/rtserve/protocol/grpc_service_pb2.py
