"""Server CPU per answered request, goodput and p99 of two rtserve source trees, side by
side, alternating.

For a change to the hot path: each tree serves the benchmark MLP (or MiniLM: `--workload
minilm --seq N`) from its own process,
under a latency objective (``--config slo``: ``slo: {p99_ms: ...}``) or with a fixed window
(``--config w0``, ``w200``, ...); the suite's open-loop client offers the same Poisson load
to one, then the other (the order alternates each round). Each row: that server's CPU time
(``/proc``, user and kernel) over the requests it answered, the answers within the
objective per second and the p99 of answered requests, from each request's scheduled send.
Compare the median over rounds, not one round.

    git worktree add /tmp/before HEAD~1
    python -m bench.slo_cpu_ab --a-src src --b-src /tmp/before/src --rate 6000 --rounds 6
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.procs import cpu_split
from bench.slo_openloop import MODELS, _point, _repository, _request_body, _start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a-src", type=Path, required=True, help="one tree's src/ folder")
    parser.add_argument("--b-src", type=Path, required=True, help="the other's")
    parser.add_argument("--rate", type=float, default=6000.0, help="requests/s offered")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--objective-ms", type=float, default=10.0)
    parser.add_argument(
        "--config", default="slo", help="slo, or a fixed window in µs as w0, w200, ..."
    )
    parser.add_argument("--workload", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--seq", type=int, default=32, help="MiniLM tokens per request")
    parser.add_argument("--loadgen", choices=("python", "c"), default="python")
    parser.add_argument("--server-cpus", default="", help="pin both servers (taskset)")
    parser.add_argument("--client-cpus", default="", help="pin the client (taskset)")
    args = parser.parse_args()
    windows = [] if args.config == "slo" else [int(args.config.removeprefix("w"))]
    work = Path(tempfile.mkdtemp(prefix="slo-cpu-ab-"))
    servers: dict[str, tuple[subprocess.Popen[bytes], int, Path]] = {}
    try:
        for label, src in (("a", args.a_src), ("b", args.b_src)):
            (work / label).mkdir()
            _repository(work / label / "repo", MODELS[args.workload], args.objective_ms, windows)
            proc, port = _start(work / label / "repo", work / label, args.server_cpus, src)
            servers[label] = (proc, port, work / label)
        body = work / "body.json"
        body.write_bytes(_request_body(args.workload, args.seq))
        print(
            f"a: {args.a_src}, b: {args.b_src}; {args.workload} as {args.config}, "
            f"{args.rate:g} requests/s offered ({args.loadgen} client"
            f"{', on CPUs ' + args.client_cpus if args.client_cpus else ''}"
            f"{'; servers on CPUs ' + args.server_cpus if args.server_cpus else ''})"
        )
        print(
            "| round | tree | codes | server CPU per answer (µs) | of which user "
            f"| answers within {args.objective_ms:g} ms /s | p99 ms |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        per: dict[str, list[float]] = {label: [] for label in servers}
        good: dict[str, list[float]] = {label: [] for label in servers}
        p99: dict[str, list[float]] = {label: [] for label in servers}
        for k in range(args.rounds):
            for label in list(servers) if k % 2 == 0 else list(servers)[::-1]:
                proc, port, folder = servers[label]
                url = f"http://127.0.0.1:{port}/v2/models/{args.config}/infer"
                user0, system0 = cpu_split(proc.pid)
                r = _point(
                    url, label, body, args.rate, args.seconds, 1, args.client_cpus, folder,
                    k + 1, loadgen=args.loadgen,
                )  # fmt: skip
                user1, system1 = cpu_split(proc.pid)
                answered = max(1, r["codes"].get("200", 0))
                cpu = 1e6 * (user1 - user0 + system1 - system0) / answered
                within = float((r["latencies"] <= args.objective_ms).sum()) / args.seconds
                per[label].append(cpu)
                good[label].append(within)
                p99[label].append(r["p99_ms"])
                print(
                    f"| {k + 1} | {label} | {r['codes']} | {cpu:.1f} "
                    f"| {1e6 * (user1 - user0) / answered:.1f} | {within:.0f} "
                    f"| {r['p99_ms']:.1f} |",
                    flush=True,
                )
                time.sleep(1.0)
        a, b = (float(np.median(per[label])) for label in ("a", "b"))
        print(f"\nmedian CPU per answer: a {a:.1f} µs, b {b:.1f} µs (a/b {a / b:.3f})")
        a, b = (float(np.median(good[label])) for label in ("a", "b"))
        print(f"median answers within the objective /s: a {a:.0f}, b {b:.0f} (a/b {a / b:.3f})")
        a, b = (float(np.median(p99[label])) for label in ("a", "b"))
        print(f"median p99: a {a:.1f} ms, b {b:.1f} ms")
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
