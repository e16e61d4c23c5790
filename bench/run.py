"""``python -m bench.run [--quick]``: the serving comparison.

Quick: MLP, one row per request, V2 JSON, wrk -c32; rtserve against a bare ASGI ceiling, a raw
ASGI app running the model per request and naive FastAPI, in five alternating rounds whose
median per-round ratio is the headline (docs/benchmarks-quick.md); ``--baseline-ref REF`` adds
rtserve as of REF (a git worktree) to every round. Full: every peer, both workloads, every
client, closed and open loop (docs/benchmarks.md and its plots).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from bench import baseline, envs, limits, machine, plots, results, servers
from bench.clients import perf_analyzer, wrk
from bench.procs import http_post
from bench.report import RunRecord, render, render_details
from bench.results import Measurement, save, short_error
from bench.stats import combine_rounds, rotated, saturated
from bench.workloads import ROOT, WORKLOADS, Workload

HEADLINE_PEERS = ["rtserve", "bare_asgi", "raw_asgi", "fastapi"]
BASELINE = "rtserve_baseline"
MATRIX_ORDER = ["rtserve", "bare_asgi", "raw_asgi", "fastapi", "mlserver", "litserve", "bentoml",
                "rayserve", "pytriton", "mosec"]  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """How long and how much: the knobs that separate quick from full."""

    quick: bool
    rounds: int = 5
    pa_rounds: int | None = None  # rounds in which rtserve also gets perf_analyzer (None: all)
    headline_s: float = 8.0
    warmup_s: float = 2.0
    wrk_s: float = 4.0
    concurrencies: tuple[int, ...] = (1, 8, 32, 64)
    pa_window_ms: int = 1500
    pa_trials: int = 3
    open_s: float = 4.0
    open_drain_s: float = 3.0
    pa_open_clients: tuple[str, ...] = ("pa-http-binary",)
    matrix: bool = True
    workloads: tuple[str, ...] = ("mlp", "minilm")


# Five rounds of four servers (five with a baseline) at 4 s each, perf_analyzer in the first
# round only: about 3-4 minutes.
QUICK = Plan(quick=True, headline_s=4.0, warmup_s=1.0, pa_rounds=1, matrix=False,
             workloads=("mlp",))  # fmt: skip
FULL = Plan(quick=False)


class Suite:
    def __init__(self, plan: Plan, run_dir: Path, base: baseline.Baseline | None = None) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.loads: list[tuple[str, str, str]] = []
        self.files: dict[str, dict[str, Path]] = {}
        self.peers = dict(servers.PEERS)
        self.headline_peers = list(HEADLINE_PEERS)
        if base is not None:
            self.peers[BASELINE] = servers.baseline_peer(base.label, base.src)
            self.headline_peers.insert(1, BASELINE)

    def log(self, message: str) -> None:
        print(f"[{datetime.now():%H:%M:%S}] {message}", flush=True)

    def inputs(self, workload: Workload) -> dict[str, Path]:
        """The request body, its wrk script and its perf_analyzer data file, written once."""
        if workload.name not in self.files:
            folder = self.run_dir / "inputs" / workload.name
            folder.mkdir(parents=True, exist_ok=True)
            body = workload.v2_body()
            files = {"body": folder / "body.json", "lua": folder / "post.lua", "pa": folder / "pa-data.json"}  # fmt: skip
            files["body"].write_bytes(body)
            files["lua"].write_text(wrk.lua_script(body))
            files["pa"].write_text(workload.perf_analyzer_data())
            self.files[workload.name] = files
        return self.files[workload.name]

    @contextlib.contextmanager
    def serving(
        self, peer: servers.Peer, workload: Workload, phase: str = ""
    ) -> Iterator[servers.Running]:
        load = " / ".join(f"{v:.2f}" for v in machine.load_average())
        self.loads.append((workload.name + phase, peer.label, load))
        self.log(f"start {peer.name} ({workload.name}), load {load}")
        running = servers.start(peer, workload, self.run_dir)
        try:
            status, answer = http_post(
                running.url(workload.model_name), self.inputs(workload)["body"].read_bytes()
            )
            if status != 200:
                raise RuntimeError(f"first request answered {status}: {answer[:120]!r}")
            self._warm(running, workload)
            yield running
        finally:
            killed = servers.stop(running)
            if killed:
                self.log(f"stopped {peer.name}; had to kill {len(killed)} process(es)")

    def _warm(self, running: servers.Running, workload: Workload) -> None:
        scratch = Measurement(running.peer.name, workload.name, "wrk", "warmup", 8)
        wrk.measure(running.url(workload.model_name), self.inputs(workload)["lua"], 8,
                    self.plan.warmup_s, scratch)  # fmt: skip

    def wrk_point(
        self, running: servers.Running, workload: Workload, connections: int, seconds: float,
        round_no: int = 0,
    ) -> Measurement:  # fmt: skip
        base = Measurement(running.peer.name, workload.name, "wrk", "closed", connections,
                           round=round_no)  # fmt: skip
        return wrk.measure(running.url(workload.model_name), self.inputs(workload)["lua"],
                           connections, seconds, base)  # fmt: skip

    def pa_point(
        self,
        running: servers.Running,
        workload: Workload,
        client: str,
        *,
        concurrency: int | None = None,
        rate: float | None = None,
        round_no: int = 0,
    ) -> Measurement:
        protocol = perf_analyzer.PROTOCOLS[client][0]
        port = running.settings.grpc_port if protocol == "grpc" else running.settings.port
        mode = "open" if rate is not None else "closed"
        load = rate if rate is not None else float(concurrency or 1)
        base = Measurement(running.peer.name, workload.name, client, mode, load, round=round_no)
        csv_name = f"{workload.name}-{running.peer.name}-{client}-{mode}-{load:g}.csv"
        csv_file = self.run_dir / "pa" / csv_name
        csv_file.parent.mkdir(parents=True, exist_ok=True)
        cmd = perf_analyzer.command(client, workload.model_name, f"127.0.0.1:{port}", self.inputs(workload)["pa"],
                                    csv_file, self.plan.pa_window_ms, concurrency=concurrency, rate=rate,
                                    trials=self.plan.pa_trials)  # fmt: skip
        budget = self.plan.pa_window_ms / 1000 * (self.plan.pa_trials + 2) + 30
        point = perf_analyzer.measure(cmd, csv_file, base, timeout_s=budget)
        if point.error and "stable measurement" in point.error:
            # A window with no completed request never counts as stable: one longer retry.
            cmd[cmd.index("--measurement-interval") + 1] = str(self.plan.pa_window_ms * 2)
            point.error = None
            point = perf_analyzer.measure(cmd, csv_file, point, timeout_s=budget * 2)
            point.extra["retried"] = True
        return point

    def open_point(self, running: servers.Running, workload: Workload, rate: float) -> Measurement:
        base = Measurement(running.peer.name, workload.name, "openloop-json", "open", rate)
        cmd = [
            str(envs.main_env().python), "-m", "bench.clients.openloop",
            running.url(workload.model_name), str(self.inputs(workload)["body"]),
            "--rate", f"{rate:g}", "--duration", f"{self.plan.open_s:g}",
            "--drain", f"{self.plan.open_drain_s:g}",
        ]  # fmt: skip
        base.extra["command"] = (
            f"python -m bench.clients.openloop URL body.json {' '.join(cmd[5:])}"
        )
        limit = self.plan.open_s + self.plan.open_drain_s + 30
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=limit)
            data = json.loads(proc.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as exc:
            base.error = f"open-loop client: {short_error(str(exc))}"
            return base
        base.rps, base.errors, base.requests = data["rps"], data["errors"], data["completed"]
        base.p50_ms, base.p90_ms, base.p99_ms = data["p50_ms"], data["p90_ms"], data["p99_ms"]
        base.extra.update(unfinished=data["unfinished"], send_lag_p99_ms=data["send_lag_p99_ms"])
        if data["completed"] == 0:
            base.error = "no request completed"
        return base

    # -- the two parts of a run -------------------------------------------------------------

    def headline(self) -> list[Measurement]:
        """The core serving comparison: alternating rounds, medians and ratios taken later.

        The order of the servers rotates each round, so no server always runs first (on a
        cold machine) or right after the heaviest one.
        """
        workload = WORKLOADS["mlp"]
        points: list[Measurement] = []
        names = self.headline_peers
        pa_rounds = self.plan.rounds if self.plan.pa_rounds is None else self.plan.pa_rounds
        for round_no in range(self.plan.rounds):
            order = rotated(names, round_no)
            self.log(f"headline round {round_no + 1}/{self.plan.rounds}: {', '.join(order)}")
            for name in order:
                peer = self.peers[name]
                with_pa = name == "rtserve" and round_no < pa_rounds
                clients = ["wrk"] + (["pa-http-binary", "pa-grpc"] if with_pa else [])
                try:
                    with self.serving(peer, workload, f" (core, round {round_no + 1})") as running:
                        points.append(self.wrk_point(running, workload, 32, self.plan.headline_s,
                                                     round_no))  # fmt: skip
                        for client in clients[1:]:
                            points.append(self.pa_point(running, workload, client,
                                                        concurrency=32, round_no=round_no))  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - a failing peer becomes a row
                    self.log(f"{name} failed: {short_error(str(exc))}")
                    points += [
                        replace(Measurement.failed(name, workload.name, c, "closed", 32, str(exc)),
                                round=round_no)
                        for c in clients
                    ]  # fmt: skip
                self.log("  " + "; ".join(_summary(m) for m in points[-len(clients) :]))
        return points

    def peer_matrix(self, peer: servers.Peer, workload: Workload) -> list[Measurement]:
        """Every client and load against one peer on one workload."""
        plan = self.plan
        points: list[Measurement] = []
        planned = [("wrk", "closed", float(plan.concurrencies[-1])),
                   ("openloop-json", "open", float(workload.open_loop_rates[0]))]  # fmt: skip
        if peer.v2:
            planned += [(c, "closed", 32.0) for c in perf_analyzer.PROTOCOLS]
            planned += [
                (c, "open", float(workload.open_loop_rates[0])) for c in plan.pa_open_clients
            ]
        try:
            with self.serving(peer, workload) as running:
                for connections in plan.concurrencies:
                    points.append(self.wrk_point(running, workload, connections, plan.wrk_s))
                    self.log(f"  {_summary(points[-1])}")
                points += self._open_sweep(lambda r: self.open_point(running, workload, r),
                                           peer, workload, "openloop-json")  # fmt: skip
                if peer.v2:
                    for client in perf_analyzer.PROTOCOLS:
                        for connections in plan.concurrencies:
                            points.append(self.pa_point(running, workload, client,
                                                        concurrency=connections))  # fmt: skip
                            self.log(f"  {_summary(points[-1])}")
                    for client in plan.pa_open_clients:
                        points += self._open_sweep(
                            lambda r, c=client: self.pa_point(running, workload, c, rate=r),
                            peer, workload, client,
                        )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a failing peer becomes a row
            self.log(f"{peer.name} failed: {short_error(str(exc))}")
            if not points:
                return [Measurement.failed(peer.name, workload.name, c, m, load, str(exc))
                        for c, m, load in planned]  # fmt: skip
            points.append(Measurement.failed(peer.name, workload.name, "wrk", "closed", -1,
                                             f"aborted: {exc}"))  # fmt: skip
        return points

    def _open_sweep(
        self,
        measure: Callable[[float], Measurement],
        peer: servers.Peer,
        workload: Workload,
        client: str,
    ) -> list[Measurement]:
        """Rising Poisson rates until the first one past saturation; the rest are marked skipped."""
        points: list[Measurement] = []
        stop_reason: str | None = None
        for rate in workload.open_loop_rates:
            if stop_reason is not None:
                points.append(
                    Measurement.failed(peer.name, workload.name, client, "open", rate, stop_reason)
                )
                continue
            point = measure(float(rate))
            points.append(point)
            self.log(f"  {_summary(point)}")
            if saturated(point):
                kind = "failed" if point.error else "saturated"
                stop_reason = f"skipped: {kind} at {rate:g}"
        return points

    def matrix(self) -> tuple[list[Measurement], list[Measurement]]:
        points: list[Measurement] = []
        limit_rows: list[Measurement] = []
        for name in self.plan.workloads:
            workload = WORKLOADS[name]
            self.log(f"workload {name}: model alone in-process")
            try:
                limit_rows += limits.model_alone(workload, 0.3 if self.plan.quick else 1.0)
            except Exception as exc:  # noqa: BLE001
                limit_rows.append(
                    Measurement.failed(limits.PEER, name, "in-process", "limit", 0, str(exc))
                )
            for peer_name in MATRIX_ORDER:
                points += self.peer_matrix(servers.PEERS[peer_name], workload)
        return points, limit_rows


def _summary(m: Measurement) -> str:
    if not m.ok:
        return f"{m.peer}/{m.client}@{m.load:g}: ERROR {m.error}"
    p99 = f"{m.p99_ms:.2f}" if m.p99_ms is not None else "?"
    return f"{m.peer}/{m.client}@{m.load:g}: {m.rps:,.0f} req/s p99 {p99} ms err {m.errors}"


def versions(plan: Plan) -> dict[str, str]:
    found: dict[str, str] = {}
    main = envs.main_env()
    found["rtserve"] = envs.installed_version(main, "rtserve")
    found["onnxruntime (all servers)"] = envs.installed_version(main, "onnxruntime")
    found["uvicorn / uvloop / httptools / orjson (references)"] = " / ".join(
        envs.installed_version(main, d) for d in ("uvicorn", "uvloop", "httptools", "orjson")
    )
    for name in MATRIX_ORDER if plan.matrix else HEADLINE_PEERS:
        peer = servers.PEERS[name]
        if peer.env == "main" or peer.distribution is None:
            continue
        env = envs.peer_env(peer.env)
        if env.stamp.exists():
            found[peer.label] = envs.installed_version(env, peer.distribution)
            ort = envs.installed_version(env, "onnxruntime")
            if ort != found["onnxruntime (all servers)"]:
                found[f"{peer.label}: onnxruntime"] = ort
    found["wrk"] = machine.tool_version(["wrk", "-v"]).split(" [")[0]
    found["perf_analyzer (tritonclient)"] = envs.installed_version(main, "tritonclient")
    return found


def settings_table(plan: Plan) -> dict[str, str]:
    threads = ", ".join(
        f"{w}: intra_op {WORKLOADS[w].intra_op_threads}, inter_op {servers.INTER_OP_THREADS}"
        for w in plan.workloads
    )
    sizes = ", ".join(f"{w}: {len(WORKLOADS[w].v2_body()):,} bytes" for w in plan.workloads)
    pa = "every round" if plan.pa_rounds is None else f"the first {plan.pa_rounds} round(s)"
    rows = {
        "max batch size (every batching server)": str(servers.MAX_BATCH),
        "max batch wait (every batching server)": f"{servers.MAX_WAIT_MS:g} ms",
        "onnxruntime threads": threads,
        "instances / workers": "1 per server",
        "request": f"one row per request; V2 JSON body for every HTTP peer; {sizes}",
        "headline": f"{plan.rounds} alternating rounds x {plan.headline_s:g} s per server, "
        f"wrk -t1 -c32; perf_analyzer for rtserve in {pa}",
    }
    if plan.matrix:
        rates = "; ".join(
            f"{w}: {', '.join(f'{r:g}' for r in WORKLOADS[w].open_loop_rates)} req/s"
            for w in plan.workloads
        )
        rows["closed loop"] = (
            f"wrk -t1 -c{{{','.join(map(str, plan.concurrencies))}}} for "
            f"{plan.wrk_s:g} s after a {plan.warmup_s:g} s warm-up; perf_analyzer "
            f"{plan.pa_trials} windows of {plan.pa_window_ms} ms"
        )
        rows["open loop"] = (
            f"Poisson arrivals at {rates}, {plan.open_s:g} s each; a sweep stops "
            "after the first saturated rate"
        )
    return rows


NOTES = [
    "rtserve, MLServer and Triton speak V2, so perf_analyzer measures them over binary HTTP, JSON "
    "HTTP and gRPC; every HTTP peer gets the same V2 JSON body from wrk and the open-loop client.",
    "Each peer is set up as its documentation advises for speed: MLServer in-process, debug, gzip "
    "and metrics off; LitServe's ZeroMQ fast queue; mosec with orjson; BentoML and FastAPI without "
    "access logs; Ray Serve's max_ongoing_requests above the batch; Triton's preferred batch 32.",
    "BentoML has no max-wait knob (max_latency_ms 10 s so that it never rejects); its batch counts "
    "tensors, so max_batch_size is 32 x the inputs per request.",
    "The naive FastAPI and raw ASGI servers do not batch; bare ASGI runs no model (a limit).",
    "Open loop times each request from its scheduled arrival; 'client lag' flags points where the "
    "Python client fell behind. Its own ceiling is the bare ASGI row.",
    "perf_analyzer needs the Triton model-config extension; a server without it fails those rows.",
]


def _command_line(args: list[str]) -> str:
    if args == ["--quick"]:
        return "make bench-quick (python -m bench.run --quick)"
    if not args:
        return "make bench (python -m bench.run)"
    return "python -m bench.run " + shlex.join(args)


def main(argv: list[str] | None = None) -> int:
    parser = results.parser("python -m bench serving|quick", __doc__)
    parser.add_argument("--quick", action="store_true", help="the core comparison only (~4 min)")
    parser.add_argument("--rounds", type=int, help="headline rounds (default 5)")
    parser.add_argument("--baseline-ref", metavar="GIT_REF", help="also rtserve as of this commit "
                        "(a git worktree, same venv) in every headline round")  # fmt: skip
    parser.add_argument("--out", type=Path, help="report path (default docs/benchmarks[-quick].md)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan = replace(plan, rounds=args.rounds)
    out = args.out or ROOT / "docs" / ("benchmarks-quick.md" if plan.quick else "benchmarks.md")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = ROOT / "bench" / "results" / "raw" / f"{stamp}-{'quick' if plan.quick else 'full'}"
    run_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        base = None
        if args.baseline_ref:
            try:
                base = stack.enter_context(baseline.checkout(args.baseline_ref))
            except RuntimeError as exc:
                parser.error(str(exc))
        return _measure(plan, run_dir, out, base, argv)
    return 1  # not reached: the block returns


def _measure(
    plan: Plan, run_dir: Path, out: Path, base: baseline.Baseline | None, argv: list[str] | None
) -> int:
    started = time.monotonic()
    suite = Suite(plan, run_dir, base)
    order = list(MATRIX_ORDER)
    labels = {name: p.label for name, p in suite.peers.items()} | {limits.PEER: "onnxruntime alone"}
    if base is not None:
        order.insert(1, BASELINE)
    record = RunRecord(
        mode="quick" if plan.quick else "full", command=_command_line(sys.argv[1:] if argv is None else argv),
        started=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), duration_s=0.0,
        machine=machine.facts(), versions={}, settings=settings_table(plan), labels=labels,
        order=order, notes=[NOTES[3]] if plan.quick else list(NOTES),
    )  # fmt: skip
    raw: list[Measurement] = []
    try:
        if base is not None:
            record.baseline = f"`{base.ref}` = {base.sha[:10]} ({base.subject})"
        headline = suite.headline()
        raw += headline
        record.headline = combine_rounds(headline)
        record.headline_rounds = [m for m in headline if m.client == "wrk"]
        if plan.matrix:
            record.matrix, record.limits = suite.matrix()
            raw += record.matrix + record.limits
        else:
            record.limits = limits.model_alone(WORKLOADS["mlp"], 0.3)
    except KeyboardInterrupt:
        suite.log("interrupted: writing what was measured")
    except Exception:  # noqa: BLE001 - write the report of what was measured anyway
        traceback.print_exc()
        record.notes.append("The run stopped early on an internal error; see the console log.")
    save(run_dir / "results.jsonl", raw)
    for m in raw:
        if "command" in m.extra:
            short = m.extra["command"].replace(str(ROOT) + "/", "")
            record.commands.setdefault(f"{m.client} ({m.mode})", short)
    record.loads = suite.loads
    record.versions = versions(plan)
    if base is not None:
        record.versions[labels[BASELINE]] = f"{base.sha[:10]}: {base.subject}"
    record.duration_s = time.monotonic() - started
    record.plots = draw_plots(record) if plan.matrix else []
    publish(record, out)
    suite.log(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} "
              f"in {record.duration_s / 60:.1f} min")  # fmt: skip
    return 0


def draw_plots(record: RunRecord) -> list[tuple[str, str]]:
    """The closed- and open-loop PNGs under docs/img; returns (caption, path from docs/)."""
    drawn: list[tuple[str, str]] = []
    for name in sorted({m.workload for m in record.matrix}, key=lambda w: (w != "mlp", w)):
        for mode, client, kind in (
            ("closed", "wrk", "wrk closed loop"),
            ("open", "openloop-json", "Poisson open loop"),
        ):
            chosen = [m for m in record.matrix
                      if m.workload == name and m.client == client and m.mode == mode]  # fmt: skip
            if chosen:
                path = ROOT / "docs" / "img" / f"bench-{name}-{mode}.png"
                caption = f"{name}: {kind}, V2 JSON"
                plots.draw(mode, chosen, record.order, record.labels, caption, path)
                drawn.append((caption, f"img/{path.name}"))
    return drawn


# The full run's evidence (every load point), beside the raw results rather than in docs/.
DETAILS = ROOT / "bench" / "results" / "benchmarks-detail.md"


def publish(record: RunRecord, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if record.mode.startswith("quick"):
        out.write_text(render(record, "Benchmarks (quick): the core serving comparison"))
        return
    DETAILS.write_text(render_details(record, "Benchmarks"))
    link = Path(os.path.relpath(DETAILS, out.parent)).as_posix()
    out.write_text(render(record, "Benchmarks", details=link))


if __name__ == "__main__":
    sys.exit(main())
