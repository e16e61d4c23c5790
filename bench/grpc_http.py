"""gRPC against HTTP binary on one server: perf_analyzer, the one-row MLP, closed loop.

Rounds alternate the order of the variants; each run gets a fresh server:

    python -m bench.grpc_http [--rounds 3] [--concurrency 32] [--variants http,grpc,grpcio]

``http``: HTTP/1.1 with binary tensors; ``grpc``: rtserve's own HTTP/2 transport (the
default); ``grpcio``: ``--grpc-server grpcio``; ``grpc-stream`` / ``grpcio-stream``: the
same over ModelStreamInfer (perf_analyzer ``--streaming``). ``--workers N`` serves with N workers.
Prints one line per run and a markdown table of the rounds, the medians and each variant's
ratio to HTTP binary (the median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.clients import perf_analyzer
from bench.envs import MAIN_VENV
from bench.procs import Server, free_port
from bench.results import Measurement

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "examples" / "repository" / "mlp"
CLIENT = {
    "http": "pa-http-binary",
    "grpc": "pa-grpc",
    "grpcio": "pa-grpc",
    "grpc-stream": "pa-grpc",
    "grpcio-stream": "pa-grpc",
}


def _data_file(folder: Path) -> Path:
    from bench.workloads import MLP as WORKLOAD

    path = folder / "pa-data.json"
    path.write_text(WORKLOAD.perf_analyzer_data())
    return path


def run_one(
    variant: str, repo: Path, data: Path, folder: Path, concurrency: int, workers: int
) -> dict[str, float]:
    http_port, grpc_port = free_port(), free_port()
    argv = [
        str(MAIN_VENV / "bin" / "rtserve"), "serve", "--model-repository", str(repo),
        "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--log-level", "warning",
    ]  # fmt: skip
    if variant.startswith("grpcio"):
        argv += ["--grpc-server", "grpcio"]
    if workers > 1:
        argv += ["--workers", str(workers)]
    server = Server(variant, argv, {"PATH": "/usr/bin:/bin"}, folder / f"{variant}.log", ROOT)
    try:
        server.wait_ready(f"http://127.0.0.1:{http_port}/v2/health/ready", 60)
        port = http_port if variant == "http" else grpc_port
        csv_file = folder / f"{variant}.csv"
        cmd = perf_analyzer.command(
            CLIENT[variant], "mlp", f"127.0.0.1:{port}", data, csv_file, 3000,
            concurrency=concurrency,
        )  # fmt: skip
        if variant.endswith("-stream"):
            cmd.append("--streaming")  # ModelStreamInfer: one bidirectional stream
        point = perf_analyzer.measure(
            cmd, csv_file, Measurement(variant, "mlp", "pa", "closed", concurrency), 120
        )
        if point.error:
            raise RuntimeError(f"{variant}: {point.error}")
        return {"rps": point.rps, "p99_ms": point.p99_ms or 0.0}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--variants", default="http,grpc,grpcio")
    args = parser.parse_args()
    variants = args.variants.split(",")
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        repo = folder / "repo"
        repo.mkdir()
        (repo / "mlp").symlink_to(MLP)
        data = _data_file(folder)
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                got = run_one(v, repo, data, folder, args.concurrency, args.workers)
                results[v].append(got)
                print(f"round {r + 1} {v}: {got['rps']:.0f} infer/s p99 {got['p99_ms']:.1f} ms")
                sys.stdout.flush()
    print()
    print("| variant | rounds (infer/s) | median | vs HTTP binary | p99 (median) |")
    print("| --- | --- | ---: | ---: | ---: |")
    base = results.get("http")
    for v in variants:
        rps = [x["rps"] for x in results[v]]
        ratio = (
            statistics.median(a["rps"] / b["rps"] for a, b in zip(results[v], base, strict=True))
            if base
            else float("nan")
        )
        shown = " / ".join(f"{x / 1000:.1f}k" for x in rps)
        p99 = statistics.median(x["p99_ms"] for x in results[v])
        print(
            f"| {v} | {shown} | {statistics.median(rps) / 1000:.1f}k | {ratio:.2f}x | {p99:.1f} ms |"
        )


if __name__ == "__main__":
    main()
