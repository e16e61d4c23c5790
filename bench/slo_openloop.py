"""Open-loop benchmark of the SLO controller against fixed batching windows (and Triton).

One rtserve serves the model as several configurations (``slo: {p99_ms}`` and fixed windows
of N µs); Poisson clients offer 0.2x-3x of the measured capacity to one at a time, in
rotating order. Per point: goodput (answers within the objective per second, timed at the
client from each scheduled send) and the p99 of the answers. ``--workload mlp4096`` is a
compute-heavy MLP built here; ``--server-cpus``/``--client-cpus`` pin with taskset.

    python -m bench.slo_openloop --out bench/results/slo/mlp.md   # + .json, .png beside it
    python -m bench.slo_openloop --combine A.json B.json ...      # rounds side by side
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench import machine, procs, results, servers
from bench.clients import openloop, openloop_c
from bench.peers.common import TensorSpec
from bench.plots import plt, save
from bench.report import markdown_table
from bench.stats import rotated
from bench.workloads import ROOT, WORK, Workload

MODELS = {
    "mlp": ROOT / "examples" / "repository" / "mlp" / "1" / "model.onnx",
    "mlp4096": WORK / "models" / "mlp4096" / "model.onnx",
    "minilm": ROOT / "examples" / "repository" / "minilm-int8" / "1" / "model.onnx",
}
CONNECTIONS = 1024  # the most connections per client process
DRAIN_S = 5.0  # a request unanswered this long after the last send is lost


def _model_file(workload: str) -> Path:
    """The workload's ONNX file; ``mlp4096`` (256->4096->4096->10 FP32, seeded, ~36 MFLOP a
    row, so its batches cost milliseconds) is built on first use."""
    path = MODELS[workload]
    if workload == "mlp4096" and not path.exists():
        from examples.build_repository import build_mlp

        tmp = path.with_suffix(f".{os.getpid()}")
        build_mlp(tmp, 0, sizes=(256, 4096, 4096, 10), name="mlp4096")
        tmp.replace(path)
    return path


def _request_body(workload: str, seq: int) -> bytes:
    rng = np.random.default_rng(0)
    if workload.startswith("mlp"):
        x = rng.normal(size=256).astype(np.float32).tolist()
        inputs = [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": x}]
    else:
        ids = [101, *rng.integers(1000, 20000, size=seq - 2).tolist(), 102]
        inputs = [
            {"name": "input_ids", "shape": [1, seq], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, seq], "datatype": "INT64", "data": [1] * seq},
        ]
    return json.dumps({"inputs": inputs}).encode()


# ---------------------------------------------------------------------------- servers
def _repository(root: Path, model: Path, objective_ms: float, windows: list[int], max_batch: int):
    """One model config per configuration: ``slo`` and ``w<µs>`` for each fixed window."""
    base = {
        "max_batch_size": max_batch,
        "instance_count": 1,
        "onnxruntime": {"intra_op_threads": 1, "inter_op_threads": 1},
        "warmup": {"batch_sizes": sorted({1, max(1, max_batch // 4), max_batch}), "iterations": 3},
    }
    configs = {"slo": {**base, "slo": {"p99_ms": objective_ms}}}
    for w in windows:
        batching = {"max_queue_delay_us": w, "preferred_batch_sizes": [max_batch]}
        configs[f"w{w}"] = {**base, "dynamic_batching": {**batching, "max_queue_size": 2048}}
    for name, cfg in configs.items():
        (root / name / "1").mkdir(parents=True)
        shutil.copy(model, root / name / "1" / "model.onnx")
        (root / name / "config.yaml").write_text(yaml.safe_dump(cfg))
    return list(configs)


def _pytriton(workload: str, model: Path, seq: int, windows: list[int], work: Path):
    """Triton (bundled by PyTriton) with its dynamic batcher, one server per window (µs),
    serving the same ONNX file on one ONNX Runtime thread: label -> (infer URL, handle)."""
    inputs: tuple[TensorSpec, ...] = (TensorSpec("input", "FP32", (256,)),)
    if workload.startswith("mlp"):
        outputs = (TensorSpec("output", "FP32", (10,)),)
    else:
        inputs = tuple(TensorSpec(n, "INT64", (seq,)) for n in ("input_ids", "attention_mask"))
        outputs = (TensorSpec("embedding", "FP32", (384,)),)
    spec = Workload(f"slo-{workload}-{seq}", workload, inputs, outputs, 1, (),
                    lambda path: Path(shutil.copy(model, path)), dict)  # fmt: skip
    served = WORK / "models" / spec.name / "model.onnx"
    served.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(model, served)  # always the file given, not one from an earlier run
    running: dict[str, tuple[str, Any]] = {}
    for w in windows:
        r = servers.start(servers.PEERS["pytriton"], spec, work, max_wait_ms=w / 1000)
        running[f"triton-w{w}"] = (r.url(workload), r)
    return running


def _server_state(port: int, model: str, objective_ms: float) -> dict[str, float]:
    """One rtserve configuration's counters from /metrics: answers within the objective as
    the server timed them (the histogram bucket at the objective, or the largest below),
    all answers, and for ``slo`` the budget factor and the batches run (count and rows)."""
    from rtserve.observability.metrics import LATENCY_BUCKETS

    bound = max((b for b in LATENCY_BUCKETS if b <= objective_ms / 1e3 + 1e-12), default=0.0)
    slo_metrics = (
        "rtserve_slo_budget_factor",
        "rtserve_batch_size_sum",
        "rtserve_batch_size_count",
    )
    out = {"within": 0.0, "answered": 0.0}
    for name, labels, value in procs.metrics(f"http://127.0.0.1:{port}"):
        if labels.get("model") != model:
            continue
        if name == "rtserve_request_duration_seconds_bucket":
            if labels["le"] == "+Inf":
                out["answered"] = value
            elif abs(float(labels["le"]) - bound) < 1e-12:
                out["within"] = value
        elif name in slo_metrics:
            out[name] = value
    return out


def _post_s(url: str, body: bytes, timeout_s: float = 30.0) -> tuple[int, float]:
    """One POST: (status, 0 without an answer; the seconds it took)."""
    t0 = time.perf_counter()
    try:
        status = procs.http_post(url, body, timeout_s)[0]
    except OSError:
        status = 0
    return status, time.perf_counter() - t0


# ---------------------------------------------------------------------------- the sweep
@dataclass
class _Sweep:
    args: argparse.Namespace
    urls: dict[str, str]  # configuration -> infer URL
    body: Path
    port: int
    triton: dict[str, tuple[str, Any]]
    work: Path

    def only(self, active: str) -> None:
        """Freeze (SIGSTOP) every Triton server but ``active``'s: an idle PyTriton keeps a
        core busy polling (~12% each), taken from whichever configuration is measured."""
        for label, (_, handle) in self.triton.items():
            with contextlib.suppress(ProcessLookupError):  # its own session: pgid = pid
                os.killpg(handle.server.pid, signal.SIGCONT if label == active else signal.SIGSTOP)

    def settle(self, m: str, within_s: float, timeout_s: float = 180.0) -> float:
        """Wait until ``m`` answers within ``within_s`` twice in a row (a configuration
        past overload still computes requests whose clients gave up; that must not take the
        CPU from the next point); the seconds waited."""
        started, fast = time.monotonic(), 0
        while fast < 2 and time.monotonic() - started < timeout_s:
            status, took = _post_s(self.urls[m], self.body.read_bytes(), timeout_s)
            fast = fast + 1 if status == 200 and took <= within_s else 0
            if not fast:
                time.sleep(0.2)
        return time.monotonic() - started

    def point(self, m: str, rate: float, seconds: float, seed: int) -> dict[str, Any]:
        """Offer ``rate`` requests/s to ``m`` for ``seconds`` from ``--clients`` processes of
        the Python client (``bench.clients.openloop``) or its C twin (~1/3 of the CPU)."""
        self.only(m)
        args, url, running = self.args, self.urls[m], []
        for k in range(args.clients):
            result = self.work / f"client-{k}.json"
            result.unlink(missing_ok=True)
            share = rate / args.clients
            if args.loadgen == "c":
                host, port = url.split("/")[2].split(":")
                request = self.work / f"request-{k}.http"
                path = "/" + url.split("/", 3)[3]
                request.write_bytes(
                    openloop.post_request(host, int(port), path, self.body.read_bytes())
                )
                cmd = openloop_c.command(host, int(port), request, share, seconds,
                                         seed * 100 + k + 1, CONNECTIONS, DRAIN_S, result)  # fmt: skip
            else:
                cmd = openloop.command(url, self.body, share, seconds, seed * 100 + k,
                                       CONNECTIONS, DRAIN_S, result)  # fmt: skip
            pin = ["taskset", "-c", args.client_cpus] if args.client_cpus else []
            running.append((subprocess.Popen([*pin, *cmd], cwd=ROOT), result))
        results = []
        for proc, result in running:
            proc.wait(seconds + 60)
            results.append(json.loads(result.read_text()))
        codes: collections.Counter[str] = collections.Counter()
        for r in results:
            codes.update(r["codes"])
        lat = np.asarray([x for r in results for x in r["latency_ms"]])
        pct = (lambda q: float(np.percentile(lat, q))) if lat.size else (lambda q: float("nan"))
        return {
            "model": m,
            "offered": rate,
            "scheduled": sum(r["scheduled"] for r in results),
            "ok": int(lat.size),
            "codes": dict(codes),
            "unfinished": sum(r["unfinished"] for r in results),
            "elapsed": max(r["elapsed"] for r in results),
            "client_lag_p99_ms": max(r["lag_p99_ms"] for r in results),
            "latencies": lat,
            "p50_ms": pct(50),
            "p99_ms": pct(99),
        }

    def load_point(self, m: str, load: float, i: int, capacity: float, within_s: float):
        """``m`` at ``load`` x capacity: goodput, latencies and the server's own counters."""
        objective, rtserve = self.args.objective_ms, not m.startswith("triton")
        before = _server_state(self.port, m, objective) if rtserve else {}
        r = self.point(m, load * capacity, self.args.seconds, i)
        r["drained_s"] = self.settle(m, within_s)
        if rtserve:
            after = _server_state(self.port, m, objective)
            delta = {k: after[k] - before[k] for k in before}
            r["server_within"] = delta["within"] / delta["answered"] if delta["answered"] else None
        if m == "slo":
            r["slo_factor"] = after["rtserve_slo_budget_factor"]
            total, batches = delta["rtserve_batch_size_sum"], delta["rtserve_batch_size_count"]
            r["slo_batch_rows"] = total / max(1.0, batches)
        r["load"] = load
        r["goodput"] = int((r["latencies"] <= objective).sum()) / self.args.seconds
        slo = (
            f"  factor {r['slo_factor']:.2f}  batch {r['slo_batch_rows']:.1f}" if m == "slo" else ""
        )
        print(f"load {load:>4}x {m:>6}: goodput {r['goodput']:8.0f}/s  ok {r['ok']:6d}  "
              f"p99 {r['p99_ms']:8.2f} ms  codes {r['codes']}  lost {r['unfinished']}  "
              f"client lag p99 {r['client_lag_p99_ms']:.1f} ms  drained {r['drained_s']:.1f} s{slo}",
              flush=True)  # fmt: skip
        return r

    def run(self, loads: list[float]) -> tuple[float, list[dict[str, Any]]]:
        """The capacity, then every configuration at every load; (capacity, points)."""
        args, models = self.args, list(self.urls)
        # Drained: one request answered within half the objective, or within twice the idle
        # configuration's time where that is longer (PyTriton on the MLP).
        settled = {}
        for m in models:
            self.only(m)
            idle = np.median([_post_s(self.urls[m], self.body.read_bytes())[1] for _ in range(7)])
            settled[m] = max(args.objective_ms / 2e3, 2 * float(idle))
        # Capacity: the most answers per second any configuration gives under heavy overload.
        capacity = args.capacity
        for m in models if not capacity else []:
            probe = self.point(m, args.probe_rate, 2, 99)
            capacity = max(capacity, probe["ok"] / probe["elapsed"])
            self.settle(m, settled[m])
        print(f"capacity ~{capacity:.0f} answers/s", flush=True)
        rows = [
            self.load_point(m, load, i, capacity, settled[m])
            for i, load in enumerate(loads)
            for m in rotated(models, i)
        ]
        return capacity, rows


def _ints(text: str) -> list[int]:
    return [int(w) for w in text.split(",") if w]


def _parser() -> argparse.ArgumentParser:
    parser = results.parser("python -m bench slo", __doc__)
    add = parser.add_argument
    add("--workload", choices=sorted(MODELS), default="mlp")
    add("--seq", type=int, default=32, help="MiniLM tokens per request")
    add("--max-batch", type=int, default=32, help="max_batch_size of each config")
    add("--src", type=Path, help="serve from this source tree (an older commit's, for an A/B)")
    add("--objective-ms", type=float, default=10.0)
    add("--loads", default="0.2,0.5,1,1.5,2,3")
    add("--windows", default="0,200,1000,5000", help="fixed windows, µs")
    add("--triton-windows", default="", help="also Triton (PyTriton), one server per window (µs)")
    add("--seconds", type=float, default=3.0)
    add("--probe-rate", type=float, default=60_000, help="offered to find the capacity")
    add("--capacity", type=float, default=0.0, help="answers/s the loads multiply (0: measure)")
    add("--clients", type=int, default=2, help="client processes")
    add("--loadgen", choices=("python", "c"), default="python", help="the open-loop client")
    add("--server-cpus", default="")
    add("--client-cpus", default="")
    add("--out", type=Path, default=None)
    add("--combine", nargs="+", type=Path, help="a per-round summary of earlier runs' .json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    args.command = " ".join(sys.argv[1:] if argv is None else argv)
    if args.combine:
        print("\n".join(_combine(args.combine, args.objective_ms)))
        return
    # A SIGTERM (``timeout``, a kill by PID) ends the run as Ctrl-C does: the ``finally``
    # below stops every server started, frozen Triton servers included.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="slo-bench-"))
    model_file = _model_file(args.workload)
    windows, repo = _ints(args.windows), work / "repo"
    models = _repository(repo, model_file, args.objective_ms, windows, args.max_batch)
    body = work / "body.json"
    body.write_bytes(_request_body(args.workload, args.seq))
    server, ports = procs.rtserve(
        work, "--model-repository", str(repo), cpus=args.server_cpus, src=args.src
    )
    port = ports["http_port"]
    urls = {m: f"http://127.0.0.1:{port}/v2/models/{m}/infer" for m in models}
    sweep = _Sweep(args, urls, body, port, {}, work)
    try:
        tw = _ints(args.triton_windows)
        sweep.triton = _pytriton(args.workload, model_file, args.seq, tw, work)
        urls.update({label: url for label, (url, _) in sweep.triton.items()})
        capacity, rows = sweep.run([float(x) for x in args.loads.split(",")])
    finally:
        for label, (_, handle) in sweep.triton.items():
            sweep.only(label)  # running again, so that it can stop
            servers.stop(handle)
        server.stop(grace_s=30)
    if args.out is not None:
        _write(args, rows, list(urls), capacity, time.monotonic() - started)


# ---------------------------------------------------------------------------- report
def _best(rows: list[dict], labels: list[str]) -> dict | None:
    return max((r for r in rows if r["model"] in labels), key=lambda r: r["goodput"], default=None)


def _combine(paths: list[Path], objective: float) -> list[str]:
    """Rounds side by side: per load, each round's SLO goodput over the best other
    configuration's (fixed windows and Triton), their median, and each round's SLO p99."""
    rounds = [json.loads(p.read_text()) for p in paths]
    table = []
    for load in sorted({r["load"] for rows in rounds for r in rows}):
        ratios, p99s = [], []
        for rows in rounds:
            at = [r for r in rows if r["load"] == load]
            s = next(r for r in at if r["model"] == "slo")
            other = _best(at, [r["model"] for r in at if r["model"] != "slo"])
            best = other["goodput"] if other else 0.0
            ratios.append(s["goodput"] / best if best > 0 else float("inf"))
            p99s.append(s["p99_ms"])
        table.append([f"{load:g}x", ", ".join(f"{x:.2f}" for x in ratios), f"{float(np.median(ratios)):.2f}",
                      ", ".join(f"{p:.0f}" for p in p99s), f"{sum(p <= objective for p in p99s)} of {len(p99s)}"])  # fmt: skip
    return markdown_table(["load", "SLO / best other, each round", "median", "SLO p99 ms, each round",
                           f"rounds with SLO p99 <= {objective:g} ms"], table)  # fmt: skip


def _plot(rows: list[dict], models: list[str], objective: float, path: Path, title: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in models:
        pts = sorted((r for r in rows if r["model"] == m), key=lambda r: r["load"])
        style: dict = {"marker": "o", "markersize": 4}
        label = f"rtserve fixed {m}" if m.startswith("w") else m
        if m == "slo":
            style = {"marker": "o", "linewidth": 2.6, "color": "black", "zorder": 5}
            label = "rtserve SLO controller"
        elif m.startswith("triton"):
            style = {"marker": "s", "markersize": 4, "linestyle": "--"}
        loads = [r["load"] for r in pts]
        left.plot(loads, [r["goodput"] for r in pts], label=label, **style)
        right.plot(loads, [max(r["p99_ms"], 0.1) for r in pts], label=label, **style)
    left.set(xlabel="offered load (x capacity)", ylabel="goodput (answers within objective)/s")
    right.set(xlabel="offered load (x capacity)", ylabel="p99 of answered requests (ms)")
    right.set_yscale("log")
    right.axhline(objective, color="red", linewidth=1, linestyle=":", label="objective")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle(title)
    save(fig, path, dpi=90)


def _write(args, rows, models, capacity, took) -> None:  # type: ignore[no-untyped-def]
    """The round's page (``--out``), its raw points (.json) and plot (.png) beside it."""
    objective = args.objective_ms
    groups = {name: [m for m in models if m.startswith(prefix)]
              for name, prefix in (("fixed", "w"), ("Triton", "triton"))}  # fmt: skip
    groups = {name: labels for name, labels in groups.items() if labels}
    header = ["load", "SLO goodput/s", "SLO p99 ms", "SLO refused"]
    for name in groups:
        header += [f"best {name}", "goodput/s", "p99 ms"]
    table = []
    for load in sorted({r["load"] for r in rows}):
        at = [r for r in rows if r["load"] == load]
        s = next(r for r in at if r["model"] == "slo")
        row = [
            f"{load:g}x",
            f"{s['goodput']:.0f}",
            f"{s['p99_ms']:.1f}",
            str(s["codes"].get("429", 0)),
        ]
        others = [0.0]
        for labels in groups.values():
            x = _best(at, labels)
            row += [x["model"], f"{x['goodput']:.0f}", f"{x['p99_ms']:.1f}"] if x else ["-"] * 3
            others.append(x["goodput"] if x else 0.0)
        table.append([*row, f"{s['goodput'] / max(others):.2f}" if max(others) > 0 else "inf"])
    points = [[f"{r['load']:g}x", r["model"], f"{r['goodput']:.0f}", str(r["ok"]), f"{r['p50_ms']:.2f}",
               f"{r['p99_ms']:.2f}", str(r["codes"]), str(r["unfinished"]), f"{r['client_lag_p99_ms']:.1f}",
               "-" if r.get("server_within") is None else f"{100 * r['server_within']:.2f}%",
               f"{r['slo_factor']:.2f}, {r['slo_batch_rows']:.1f}" if "slo_factor" in r else ""]
              for r in rows]  # fmt: skip
    what = args.workload + (f" seq {args.seq}" if args.workload == "minilm" else "")
    how = (
        "given" if args.capacity else "measured first, the best configuration under heavy overload"
    )
    pins = (f", pinned to CPUs {args.client_cpus}" if args.client_cpus else "") + (
        f"; server pinned to CPUs {args.server_cpus}" if args.server_cpus else "")  # fmt: skip
    png = args.out.with_suffix(".png")
    lines = [
        f"### {what}, objective p99 {objective:g} ms", "",
        f"Command: `python -m bench.slo_openloop {args.command}`", "",
        f"Machine: {machine.summary()}. Took {took:.0f} s. Capacity: ~{capacity:.0f} answers/s ({how}). "
        f"Latency from each request's scheduled send, at the client; {args.clients} client process(es) "
        f"({'C' if args.loadgen == 'c' else 'Python'}{pins}), Poisson arrivals, {args.seconds:g} s per "
        "point, configurations in rotating order.", "",
        "Goodput = answers within the objective per second; p99 over the answered requests. `best "
        "fixed` / `best Triton`: the window with the most goodput at that load.", "",
        *markdown_table([*header, "SLO / best other"], table), "",
        f"Every point (`lost`: unanswered {DRAIN_S:g} s after the last send; `client lag`: p99 of how "
        "late the client sent; `server-timed`: share of rtserve's answers within the objective by "
        "its own latency histogram):", "",
        *markdown_table(["load", "config", "goodput/s", "ok", "p50 ms", "p99 ms", "codes", "lost",
                         "client lag p99 ms", f"server-timed within {objective:g} ms",
                         "SLO budget factor, mean batch"], points),
        "", f"![goodput and p99 against offered load]({png.name})", "",
    ]  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _plot(rows, models, objective, png, f"{what}: SLO controller vs fixed windows")
    args.out.write_text("\n".join(lines) + "\n")
    raw = [{k: v for k, v in r.items() if k != "latencies"} for r in rows]
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
