"""Ray Serve through ``rtserve.ray`` against rtserve alone, on the same repository and machine:
wrk at 32 connections, the one-row MLP JSON body, alternating rounds, the median of each.

    .venv/bin/python -m bench.ray_serve --rounds 3 --duration 10
    .venv/bin/python -m bench.ray_serve --generative --rounds 3

Ray runs with 2 CPUs and no dashboard, its Serve proxy on 127.0.0.1, one replica by default
(``--replicas``); both servers load only ``mlp`` from ``examples/repository``. With
``--generative`` both serve SmolLM2 (``examples/llm-repository``, the replica given both
CPUs) and the load is streamed chat completions (bench/generative.py's: 64 new tokens,
greedy, 1 and 8 concurrent streams): output tokens/s, TTFT and inter-token latency.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from bench import generative
from bench.clients import wrk
from bench.procs import Server, free_port, http_post
from bench.results import Measurement
from bench.workloads import MLP

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"model_control_mode": "explicit", "load_models": ("mlp",)}


def serve_ray(repository: str, port: int, replicas: int, llm: bool) -> None:
    """The Ray side (run in its own process): serve until SIGTERM or SIGINT."""
    import ray
    from ray import serve

    import rtserve.ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    application = rtserve.ray.app(
        repository,
        num_replicas=replicas,
        num_cpus=2 if llm else 0.5,  # Ray sets the replica's OMP_NUM_THREADS from it
        settings=None if llm else SETTINGS,
    )
    serve.run(application, name="rtserve", route_prefix="/")
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    signal.sigwait(stop)
    serve.shutdown()
    ray.shutdown()


def _start(name: str, argv: list[str], port: int, work: Path) -> Server:
    env = dict(os.environ, RAY_worker_niceness="0", RAY_USAGE_STATS_ENABLED="0")
    server = Server(name, argv, env, work / f"{name}.log", ROOT)
    server.wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", timeout_s=180)
    return server


def _mlp(servers: dict[str, int], args: argparse.Namespace, work: Path) -> None:
    """wrk on the MLP's V2 JSON body, alternating rounds; prints the medians."""
    body = MLP.v2_body()
    script = work / "mlp.lua"
    script.write_text(wrk.lua_script(body))
    results: dict[str, list[Measurement]] = {name: [] for name in servers}
    for name, port in servers.items():  # the same answer from both, and a warm-up
        url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
        status, answer = http_post(url, body)
        assert status == 200, (name, status, answer[:200])
        wrk.measure(
            url,
            script,
            args.connections,
            3,
            Measurement(name, "mlp", "wrk", "closed", args.connections),
        )
    for r in range(args.rounds):
        for name, port in servers.items():
            url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
            base = Measurement(name, "mlp", "wrk", "closed", args.connections, round=r)
            m = wrk.measure(url, script, args.connections, args.duration, base)
            results[name].append(m)
            print(f"round {r + 1} {name:14} {m.rps:8.0f} req/s  p99 {m.p99_ms:7.2f} ms  errors {m.errors}", flush=True)  # fmt: skip
    print(f"\nmedian of {args.rounds} rounds, wrk -t1 -c{args.connections} -d{args.duration:.0f}s")
    for name, rounds in results.items():
        rps = statistics.median(m.rps for m in rounds)
        p99 = statistics.median(m.p99_ms or 0.0 for m in rounds)
        print(f"{name:14} {rps:8.0f} req/s  p99 {p99:7.2f} ms")


GENERATIVE_KEYS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "errors")


def _greedy(port: int) -> str:
    body = generative.chat_body(generative.MODEL, generative.story(0), 16)
    body["stream"] = False
    del body["stream_options"]
    status, answer = http_post(f"http://127.0.0.1:{port}/v1/chat/completions", orjson.dumps(body))
    assert status == 200, (status, answer[:200])
    return str(orjson.loads(answer)["choices"][0]["message"]["content"])


def _generative(servers: dict[str, int], args: argparse.Namespace) -> None:
    """Streamed chat through each server, alternating rounds; prints the medians."""
    texts = {name: _greedy(port) for name, port in servers.items()}
    assert len(set(texts.values())) == 1, texts  # greedy: the same answer through Ray
    plan = generative.Plan(max_tokens=64, concurrency=(1, 8), closed_loop_seconds=20.0)
    rows: dict[str, list[dict[str, dict[str, Any]]]] = {name: [] for name in servers}
    for r in range(args.rounds):
        for name, port in servers.items():
            print(f"round {r + 1} {name}", flush=True)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            rows[name].append(generative.measure_throughput(url, plan))
    print(f"\nmedian of {args.rounds} rounds, {plan.max_tokens} new tokens per stream")
    for name, rounds in rows.items():
        for c in plan.concurrency:
            cells = [
                f"{key} {statistics.median(row[str(c)].get(key) or 0 for row in rounds):g}"
                for key in GENERATIVE_KEYS
            ]
            print(f"{name:14} {c:>2} streams  " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", help="examples/repository, or llm-repository")
    parser.add_argument("--generative", action="store_true", help="SmolLM2 over /v1 (SSE)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--serve-ray", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repository is None:
        args.repository = str(
            generative.LLM_REPO if args.generative else ROOT / "examples" / "repository"
        )
    if args.serve_ray:
        serve_ray(args.repository, args.serve_ray, args.replicas, args.generative)
        return
    work = Path(tempfile.mkdtemp(prefix="rtb-ray-"))
    plain_port, ray_port = free_port(), free_port()
    control = [] if args.generative else ["--model-control-mode", "explicit", "--load-model", "mlp"]
    ray_args = ["--generative"] if args.generative else []
    argvs = {
        "rtserve": (
            [sys.executable, "-m", "rtserve.cli", "serve", "--model-repository",
             args.repository, "--host", "127.0.0.1", "--http-port", str(plain_port),
             "--grpc-port", str(free_port()), *control],
            plain_port,
        ),
        f"ray-serve-{args.replicas}": (
            [sys.executable, "-m", "bench.ray_serve", "--repository", args.repository,
             "--replicas", str(args.replicas), "--serve-ray", str(ray_port), *ray_args],
            ray_port,
        ),
    }  # fmt: skip
    running = [_start(name, argv, port, work) for name, (argv, port) in argvs.items()]
    servers = {name: port for name, (_, port) in argvs.items()}
    try:
        if args.generative:
            _generative(servers, args)
        else:
            _mlp(servers, args, work)
    finally:
        for server in running:
            server.stop()


if __name__ == "__main__":
    main()
