"""What observability costs on the hot path: rtserve on the MLP (V2 JSON, wrk -c32) with
tracing off, tracing sampled at 1% and at 100% (to a local OTLP/HTTP sink), and with the
access log on; alternating rounds, each round's ratio to "off", the median as the result.

    .venv/bin/python -m bench.overhead [--rounds 5] [--seconds 5] [--out docs/benchmarks-observability.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench import machine, procs, report, servers
from bench.clients import wrk
from bench.results import Measurement
from bench.workloads import MLP, ROOT, WORK

VARIANTS: dict[str, list[str]] = {
    "off": [],
    "trace 1%": ["--trace-sample-ratio", "0.01"],
    "trace 100%": ["--trace-sample-ratio", "1.0"],
    "access log": ["--access-log"],
}


NOTE = """
Reading it: with tracing off the hot path pays one `is None` test per request (the "off" row
is the same code path as a server without the tracing flag; `docs/benchmarks-quick.md`
compares it with the code before tracing existed). A request that is not sampled costs one
random number. A sampled request is turned into 7 spans after its answer is sent, and the
SDK's batch exporter encodes and posts them on a thread that shares the GIL and the one core
the event loop has here: at 1% (about 200 traces/s) that costs ~10% of throughput and
lifts p99; at 100% the exporter is the bottleneck (0.13x). Sample a small ratio, or let
clients decide per request with a sampled `traceparent`. The access log (one `logging`
call per request) costs ~10%.
"""


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that accepts and drops every export."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _point(variant: str, args: argparse.Namespace) -> Measurement:
    return Measurement(variant, "mlp", "wrk", "closed", float(args.connections))


def _serve(variant: str, repo: Path, sink_url: str, workdir: Path) -> tuple[procs.Server, int]:
    port = procs.free_port()
    argv = [
        sys.executable, "-m", "rtserve.cli", "serve", "--model-repository", str(repo),
        "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", str(procs.free_port()),
        "--log-level", "warning",
    ]  # fmt: skip
    if variant.startswith("trace"):
        argv += ["--trace-endpoint", sink_url]
    argv += VARIANTS[variant]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    name = variant.replace(" ", "_").replace("%", "pct")
    server = procs.Server(name, argv, env, workdir / f"{name}.log", ROOT)
    server.wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", 60)
    return server, port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--seconds", type=float, default=5.0, help="wrk seconds per point")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections (32)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks-observability.md")
    args = parser.parse_args(argv)

    workdir = WORK / "overhead"
    workdir.mkdir(parents=True, exist_ok=True)
    repo = servers._rtserve_repository(servers.peer_settings(MLP, workdir), workdir)
    script = workdir / "mlp.lua"
    script.write_text(wrk.lua_script(MLP.v2_body()))
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    sink_url = f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"

    names = list(VARIANTS)
    results: dict[str, list[Measurement]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for variant in order:
            server, port = _serve(variant, repo, sink_url, workdir)
            try:
                url = f"http://127.0.0.1:{port}/v2/models/{MLP.model_name}/infer"
                wrk.measure(url, script, args.connections, 2, _point(variant, args))
                m = wrk.measure(url, script, args.connections, args.seconds, _point(variant, args))
            finally:
                server.stop()
            results[variant].append(m)
            print(f"round {r + 1} {variant}: {m.rps:,.0f} req/s p99 {m.p99_ms} ms", flush=True)
    sink.shutdown()

    rows = []
    for variant in names:
        ratios = [
            m.rps / base.rps
            for m, base in zip(results[variant], results["off"], strict=True)
            if m.rps and base.rps
        ]
        rows.append(
            [
                variant,
                report.fmt_rps(statistics.median(m.rps for m in results[variant])),
                report.fmt_ms(statistics.median(m.p99_ms or 0.0 for m in results[variant])),
                " / ".join(f"{x:.2f}" for x in ratios),
                f"{statistics.median(ratios):.2f}x" if ratios else "-",
            ]
        )
    lines = [
        "# What observability costs (MLP, V2 JSON, wrk -c32)",
        "",
        f"Command: `.venv/bin/python -m bench.overhead --rounds {args.rounds} "
        f"--seconds {args.seconds:g}`. {args.rounds} alternating rounds; each round's "
        'throughput divided by the same round\'s "off"; the median ratio is the result.',
        "Tracing exports over OTLP/HTTP to an in-process sink that drops what it gets.",
        "",
        *report.markdown_table(
            ["variant", "req/s (median)", "p99 (median)", "ratio to off, per round", "median"],
            rows,
        ),
        NOTE,
        "Machine: " + machine.summary(),
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
