#!/usr/bin/env bash
# Regenerate the Python gRPC modules for src/rtserve/protocol/grpc_service.proto.
# -Isrc makes the proto's import path rtserve/protocol/grpc_service.proto, so the
# generated _grpc module imports `from rtserve.protocol import grpc_service_pb2`.
# Needs grpcio-tools==1.62.3 (dev extra) in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" -m grpc_tools.protoc -Isrc --python_out=src --pyi_out=src --grpc_python_out=src src/rtserve/protocol/grpc_service.proto
