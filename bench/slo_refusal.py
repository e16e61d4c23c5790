"""What a refusal costs the server, refused before decoding the request or after.

Two identical models under a latency objective (a Python model that takes 200 ms per
request, objective p99 300 ms) on one rtserve process:

- ``before decoding``: Poisson requests to a model kept saturated by them: nearly every one
  arrives while a request runs and another waits, so admission refuses it before its body is
  decoded (``Batcher.refuse_early``).
- ``after decoding``: the same body with a 1 µs ``timeout`` to the idle twin: decoded, then
  refused by admission for its own deadline (the path every refusal took before).

Each row: the server's CPU time (``/proc``, user and kernel) over the requests it answered.
The body is a JSON FP32 tensor of ``--floats`` values (the cost a refusal saves grows with
it).

    python -m bench.slo_refusal --floats 16384 --rate 200 --seconds 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from bench.procs import cpu_split
from bench.slo_openloop import _point, _start

MODEL_PY = """
import time


class Model:
    def infer(self, inputs):
        time.sleep(0.2)
        return {"Y": inputs["X"][:, :1]}
"""


def _repository(root: Path, floats: int) -> None:
    for name in ("saturated", "idle"):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(MODEL_PY)
        config = {
            "backend": "python",
            "max_batch_size": 1,
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [floats]}],
            "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}],
            "slo": {"p99_ms": 300},
        }
        (root / name / "config.yaml").write_text(yaml.safe_dump(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floats", type=int, default=16384)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loadgen", choices=("python", "c"), default="python")
    parser.add_argument("--server-cpus", default="", help="pin the server (taskset)")
    parser.add_argument("--client-cpus", default="", help="pin the client (taskset)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slo-refusal-"))
    try:
        _repository(work / "repo", args.floats)
        x = np.random.default_rng(0).normal(size=args.floats).astype(np.float32)
        tensor = {"name": "X", "shape": [1, args.floats], "datatype": "FP32", "data": x.tolist()}
        plain = work / "plain.json"
        plain.write_text(json.dumps({"inputs": [tensor]}))
        timed = work / "timed.json"
        timed.write_text(json.dumps({"inputs": [tensor], "parameters": {"timeout": 1}}))
        server, port = _start(work / "repo", work, args.server_cpus)
        base = f"http://127.0.0.1:{port}/v2/models"
        variants = {
            "before decoding": (f"{base}/saturated/infer", plain),
            "after decoding": (f"{base}/idle/infer", timed),
        }
        print(f"body {plain.stat().st_size / 1e3:.0f} kB, {args.rate:g} requests/s offered")
        print(
            "| round | refused | requests | codes | server CPU per request (ms) "
            "| of which user, kernel (µs) |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        try:
            for k in range(args.rounds):
                order = list(variants) if k % 2 == 0 else list(variants)[::-1]
                for label in order:
                    url, body = variants[label]
                    user0, system0 = cpu_split(server.pid)
                    r = _point(
                        url, label, body, args.rate, args.seconds, 1, args.client_cpus, work,
                        k, loadgen=args.loadgen,
                    )  # fmt: skip
                    user1, system1 = cpu_split(server.pid)
                    count = max(1, sum(r["codes"].values()))
                    user = 1e6 * (user1 - user0) / count
                    system = 1e6 * (system1 - system0) / count
                    print(
                        f"| {k + 1} | {label} | {count} | {r['codes']} "
                        f"| {(user + system) / 1e3:.3f} | {user:.0f}, {system:.0f} |",
                        flush=True,
                    )
                    time.sleep(0.5)  # the saturated model's last admitted request ends
        finally:
            server.terminate()
            server.wait(30)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
