"""Micro-benchmark: CPU µs per V2 JSON decode of the benchmark MLP body (256 FP32 values),
this tree's codec against the one at a git revision, alternating rounds, best of each.
Decoded under the limits the server derives from the MLP's signature (4 x its 32 rows of
256 values: ``core/model.py``).

    .venv/bin/python -m bench.decode_json --baseline 5c37e43
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
import time
import timeit
from pathlib import Path
from types import ModuleType

import numpy as np
import orjson

from rtserve.config import TensorSpec
from rtserve.protocol import http_codec
from rtserve.protocol.limits import limits_for_model

ROOT = Path(__file__).resolve().parent.parent


def codec_at(rev: str) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{rev}:src/rtserve/protocol/http_codec.py"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "baseline_http_codec.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_http_codec", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bodies() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    row = [round(float(v), 6) for v in rng.random(256).astype(np.float32)]

    def body(data: object) -> bytes:
        return orjson.dumps(
            {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": data}]}
        )

    # tritonclient's JSON: float32 values widened to Python floats, ~19 characters each.
    widened = [float(v) for v in rng.random(256).astype(np.float32)]
    return {
        "flat (the benchmark body)": body(row),
        "flat, tritonclient's digits": body(widened),
        "nested [[...]]": body([row]),
        "half zeros": body([0.0] * 128 + row[:128]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    old = codec_at(args.baseline)
    limits = limits_for_model([TensorSpec("input", "FP32", (256,))], 4 * 32)
    for name, body in bodies().items():
        a = old.decode_infer_request(body, None, "mlp", "", limits).inputs[0].data
        b = http_codec.decode_infer_request(body, None, "mlp", "", limits).inputs[0].data
        assert np.array_equal(a, b) and a.dtype == b.dtype
        best = {"baseline": float("inf"), "this tree": float("inf")}
        for _ in range(args.rounds):
            for label, mod in (("baseline", old), ("this tree", http_codec)):
                t = timeit.repeat(
                    lambda m=mod, b=body: m.decode_infer_request(b, None, "mlp", "", limits),
                    number=5000, repeat=3, timer=time.process_time,
                )  # fmt: skip
                best[label] = min(best[label], min(t) / 5000 * 1e6)
        print(
            f"{name:28s} {len(body):5d} B  baseline {best['baseline']:6.2f} us   "
            f"this tree {best['this tree']:6.2f} us   ({args.baseline})"
        )


if __name__ == "__main__":
    main()
