#!/usr/bin/env bash
# rtserve on today's stacks: numpy 2, protobuf 5+, current onnx and onnxruntime.
#
# The dev venv (.venv) keeps numpy<2 / protobuf<5 because the test tools need them
# (tritonclient 2.51, grpcio-tools 1.62.3); the product must not. This script
#   1. builds a second venv (.venv-modern) holding what a current PyTorch environment has
#      (torch, numpy 2, protobuf 5+, onnx, onnxruntime, grpcio),
#   2. pip-installs rtserve from this checkout into it, as a user would,
#   3. checks that the install kept numpy 2 / protobuf 5+ and that `import onnx` still works,
#   4. loads rtserve's checked-in gRPC code under protobuf 4.25, 5.26, 5.29, 6.x and the
#      newest release, with the upb and the pure-Python runtime,
#   5. serves examples/repository (`make examples`) and queries it over plain HTTP and over
#      grpcio with rtserve's own stubs (scripts/modern_stack_smoke.py).
# Called by `make test-modern` (part of `make test`). About a minute once the venv exists.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-python3}"
VENV="${MODERN_VENV:-.venv-modern}"
REPO="${REPO:-examples/repository}"
# Protobuf releases the checked-in generated code must load under (the venv's newest too).
PROTOBUF_MATRIX="${PROTOBUF_MATRIX:-4.25 5.26 5.29 6}"

say() { printf '\n== %s\n' "$*"; }
started=$(date +%s)

test -f "$REPO/.built" || { echo "missing $REPO: run 'make examples' first" >&2; exit 1; }

say "venv $VENV with a current ML stack"
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip
# torch: the CPU wheel this project pins (a plain `torch` would pull a multi-GB CUDA build).
"$VENV/bin/pip" install -q -U "numpy>=2" "protobuf>=5" onnx onnxruntime grpcio "torch==2.13.0"

say "pip install rtserve[pipelines,trees] from this checkout"
# A fresh wheel every run, resolved against what the venv already holds.
"$VENV/bin/pip" uninstall -q -y rtserve >/dev/null 2>&1 || true
"$VENV/bin/pip" install -q ".[pipelines,trees]"  # the example pipelines and the fraud model need these
"$VENV/bin/pip" check
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import numpy, onnx, onnxruntime, torch
from google.protobuf import __version__ as pb

import rtserve.protocol.grpc_service_pb2

print(f"torch {torch.__version__}, numpy {numpy.__version__}, protobuf {pb}, onnx {onnx.__version__}, "
      f"onnxruntime {onnxruntime.__version__}, rtserve {md.version('rtserve')}")
assert int(numpy.__version__.split(".")[0]) >= 2, "installing rtserve downgraded numpy below 2"
assert int(pb.split(".")[0]) >= 5, "installing rtserve downgraded protobuf below 5"
onnx.checker.check_model(onnx.helper.make_model(onnx.helper.make_graph(
    [onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
    [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
    [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])))
print("ok    import onnx (and torch, rtserve) works after installing rtserve")
EOF

say "rtserve's generated gRPC code on each protobuf runtime"
# Older runtimes go first on PYTHONPATH, so the venv itself is never downgraded.
check_proto() {  # $1: label, $2: extra PYTHONPATH entry ('' for the venv's own protobuf)
    for impl in upb python; do
        PYTHONPATH="$2" PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="$impl" \
            "$VENV/bin/python" scripts/modern_stack_smoke_proto.py "$1"
    done
}
for version in $PROTOBUF_MATRIX; do
    target="$VENV/protobuf-matrix/$version"
    if ! test -f "$target/.done"; then
        rm -rf "$target"
        "$VENV/bin/pip" install -q --no-deps --target "$target" "protobuf==$version.*"
        touch "$target/.done"
    fi
    check_proto "$version." "$target"
done
check_proto "" ""

say "serve $REPO and query it over HTTP and grpcio"
"$VENV/bin/python" scripts/modern_stack_smoke.py --repository "$REPO"

echo "modern stack smoke passed in $(( $(date +%s) - started )) s"
