"""End-to-end GPU serving through rtserve's HTTP server, measured with wrk (docs/gpu.md).

    python bench/gpu_serve.py [--workers 4] [--duration 15] [--connections 256]

Builds a repository with two torch models (random weights): ``minilm`` (MiniLM-size BERT,
FP16, ``compile: reduce-overhead`` with batch buckets; V2 JSON requests of one 32-token row)
and ``resnet50`` (torchvision ResNet-50, FP16, channels-last, uint8 images normalised on the
GPU; V2 binary requests of one 224x224 image), serves it with ``rtserve serve --workers N``
on 127.0.0.1 and drives each model with wrk. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from torch_gpu import BERT_PY, RESNET_PY  # noqa: E402

DONE_HOOK = """
done = function(summary, latency, requests)
  io.write(string.format('BENCH_JSON {"requests":%d,"duration_us":%d,"errors":%d,'
    .. '"p50_us":%d,"p99_us":%d}\\n', summary.requests, summary.duration,
    summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.status + summary.errors.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def build_repo(root: Path, device: str, compile_mode: str, dtype: str, names: list[str]) -> None:
    models = {
        "minilm": (
            BERT_PY,
            [
                {"name": "input_ids", "datatype": "INT64", "shape": [32]},
                {"name": "attention_mask", "datatype": "INT64", "shape": [32]},
            ],
            [{"name": "embedding", "datatype": "FP32", "shape": [384]}],
            {"compile": compile_mode, "batch_buckets": [1, 2, 4, 8, 16, 32, 64, 128, 256]},
        ),
        "resnet50": (
            RESNET_PY,
            [{"name": "images", "datatype": "UINT8", "shape": [3, 224, 224]}],
            [{"name": "logits", "datatype": "FP32", "shape": [1000]}],
            {"channels_last": True},
        ),
    }
    for name, (source, inputs, outputs, extra) in models.items():
        if name not in names:
            continue
        version = root / name / "1"
        version.mkdir(parents=True)
        (version / "model_src.py").write_text(source)
        config = {
            "backend": "torch",
            "max_batch_size": 256 if name == "minilm" else 128,
            "inputs": inputs,
            "outputs": outputs,
            "dynamic_batching": {"max_queue_delay_us": 2000, "max_queue_size": 4096},
            "torch": {"factory": "model_src:build", "device": device, "dtype": dtype, **extra},
        }
        (root / name / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def lua(path: Path, body_file: Path, header_len: int | None) -> None:
    headers = 'wrk.headers["Content-Type"] = "application/octet-stream"\n'
    if header_len is not None:
        headers += f'wrk.headers["Inference-Header-Content-Length"] = "{header_len}"\n'
    else:
        headers = 'wrk.headers["Content-Type"] = "application/json"\n'
    path.write_text(
        'wrk.method = "POST"\n'
        f'local f = assert(io.open("{body_file}", "rb"))\n'
        "wrk.body = f:read('*all')\nf:close()\n" + headers + DONE_HOOK
    )


def bodies(work: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    ids = [101, *rng.integers(1000, 30000, size=30).tolist(), 102]
    minilm = {
        "inputs": [
            {"name": "input_ids", "shape": [1, 32], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, 32], "datatype": "INT64", "data": [1] * 32},
        ]
    }
    (work / "minilm.json").write_bytes(json.dumps(minilm).encode())
    lua(work / "minilm.lua", work / "minilm.json", None)
    image = rng.integers(0, 256, size=(1, 3, 224, 224), dtype=np.uint8).tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "images",
                    "shape": [1, 3, 224, 224],
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": len(image)},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
        }
    ).encode()
    (work / "resnet50.bin").write_bytes(header + image)
    lua(work / "resnet50.lua", work / "resnet50.bin", len(header))
    return {"minilm": work / "minilm.lua", "resnet50": work / "resnet50.lua"}


def mean_batch(base: str, model: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    sums = re.findall(rf'rtserve_batch_size_sum{{[^}}]*model="{model}"[^}}]*}} (\S+)', text)
    counts = re.findall(rf'rtserve_batch_size_count{{[^}}]*model="{model}"[^}}]*}} (\S+)', text)
    if not sums or not counts or float(counts[0]) == 0:
        return float("nan")
    return float(sums[0]) / float(counts[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--duration", type=int, default=15)
    parser.add_argument("--connections", default="256")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--compile", default="reduce-overhead")
    parser.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    parser.add_argument("--port", type=int, default=18000)
    parser.add_argument("--models", default="minilm,resnet50")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuserve"))
    repo = work / "repo"
    build_repo(repo, args.device, args.compile, args.dtype, args.models.split(","))
    scripts = bodies(work)
    ports = work / "ports.json"
    cmd = [
        sys.executable, "-m", "rtserve.cli", "serve", "--model-repository", str(repo),
        "--host", "127.0.0.1", "--http-port", str(args.port), "--grpc-port",
        str(args.port + 1), "--ports-file", str(ports), "--workers", str(args.workers),
        "--log-level", "warning",
    ]  # fmt: skip
    log = open(work / "server.log", "wb")  # noqa: SIM115
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{args.port}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit((work / "server.log").read_text()[-4000:])
            try:
                with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - start > 400:
                raise SystemExit("not ready in 400 s\n" + (work / "server.log").read_text()[-4000:])
            time.sleep(1)
        print(json.dumps({"ready_s": round(time.monotonic() - start, 1)}), flush=True)
        for model in args.models.split(","):
            for conns in args.connections.split(","):
                url = f"{base}/v2/models/{model}/infer"
                wrk = [
                    args.wrk, f"-t{args.threads}", f"-c{conns}", f"-d{args.duration}s",
                    "-s", str(scripts[model]), url,
                ]  # fmt: skip
                out = subprocess.run(wrk, capture_output=True, text=True, check=False)
                line = next(
                    (x for x in out.stdout.splitlines() if x.startswith("BENCH_JSON ")), None
                )
                if line is None:
                    print(out.stdout[-2000:], out.stderr[-2000:], flush=True)
                    continue
                data = json.loads(line.removeprefix("BENCH_JSON "))
                seconds = data["duration_us"] / 1e6
                print(
                    json.dumps(
                        {
                            "model": model,
                            "workers": args.workers,
                            "connections": int(conns),
                            "rps": round(data["requests"] / seconds),
                            "p50_ms": data["p50_us"] / 1e3,
                            "p99_ms": data["p99_us"] / 1e3,
                            "errors": data["errors"],
                            "mean_batch_one_worker": round(mean_batch(base, model), 1),
                        }
                    ),
                    flush=True,
                )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        print((work / "server.log").read_text()[-1500:], flush=True)


if __name__ == "__main__":
    main()
