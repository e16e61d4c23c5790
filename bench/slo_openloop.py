"""Open-loop benchmark of the SLO controller against fixed batching windows (and Triton).

One rtserve serves the model under several configurations (``slo: {p99_ms}`` and fixed
windows of 0..N µs); Poisson clients offer 0.2x-3x of the measured capacity to one at a time,
alternating. Per point: goodput (answers within the objective per second, timed at the client
from each scheduled send) and the p99 of answered requests. ``--workload mlp4096``: a
compute-heavy MLP built here. ``--server-cpus``/``--client-cpus`` pin with taskset.

    python -m bench.slo_openloop --out bench/results/slo/mlp.md   # + .json, .png beside it
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench import machine, procs, servers
from bench.clients import openloop, openloop_c, wrk
from bench.clients.wrk import lua_script
from bench.peers.common import TensorSpec
from bench.report import markdown_table
from bench.results import Measurement
from bench.stats import rotated
from bench.workloads import WORK, Workload

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "mlp": ROOT / "examples" / "repository" / "mlp" / "1" / "model.onnx",
    "mlp4096": ROOT / "bench" / ".work" / "models" / "mlp4096" / "model.onnx",
    "minilm": ROOT / "examples" / "repository" / "minilm-int8" / "1" / "model.onnx",
}


def _wide_mlp(path: Path, seed: int = 0) -> Path:
    """The 256->4096->4096->10 FP32 MLP (He-initialised, seeded), built once: the benchmark
    MLP's input and output, ~36 MFLOP per row, so its batches cost milliseconds."""
    if path.exists():
        return path
    from examples.build_repository import build_mlp

    tmp = path.with_suffix(f".{os.getpid()}")
    build_mlp(tmp, seed, sizes=(256, 4096, 4096, 10), name="mlp4096")
    tmp.replace(path)
    return path


def _model_file(workload: str) -> Path:
    return _wide_mlp(MODELS[workload]) if workload == "mlp4096" else MODELS[workload]


def _request_body(workload: str, seq: int) -> bytes:
    rng = np.random.default_rng(0)
    if workload.startswith("mlp"):
        x = rng.normal(size=(1, 256)).astype(np.float32)
        inputs = [
            {"name": "input", "shape": [1, 256], "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    else:
        ids = [101, *rng.integers(1000, 20000, size=seq - 2).tolist(), 102]
        inputs = [
            {"name": "input_ids", "shape": [1, seq], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, seq], "datatype": "INT64", "data": [1] * seq},
        ]
    return json.dumps({"inputs": inputs}).encode()


# ---------------------------------------------------------------------------- server
def _repository(
    root: Path, model: Path, objective_ms: float, windows: list[int], max_batch: int = 32
) -> list[str]:
    base = {
        "max_batch_size": max_batch,
        "instance_count": 1,
        "onnxruntime": {"intra_op_threads": 1, "inter_op_threads": 1},
        "warmup": {"batch_sizes": sorted({1, max(1, max_batch // 4), max_batch}), "iterations": 3},
    }
    configs = {"slo": {**base, "slo": {"p99_ms": objective_ms}}}
    for w in windows:
        configs[f"w{w}"] = {
            **base,
            "dynamic_batching": {
                "max_queue_delay_us": w,
                "preferred_batch_sizes": [max_batch],
                "max_queue_size": 2048,
            },
        }
    for name, cfg in configs.items():
        (root / name / "1").mkdir(parents=True)
        shutil.copy(model, root / name / "1" / "model.onnx")
        (root / name / "config.yaml").write_text(yaml.safe_dump(cfg))
    return list(configs)


def _pytriton(
    workload: str, model: Path, seq: int, windows: list[int], work: Path
) -> dict[str, tuple[str, object]]:
    """Triton (bundled by PyTriton) with its dynamic batcher, one server per window (µs),
    serving the same ONNX file on one ONNX Runtime thread: label -> (infer URL, handle)."""
    if workload.startswith("mlp"):
        inputs = (TensorSpec("input", "FP32", (256,)),)
        outputs = (TensorSpec("output", "FP32", (10,)),)
    else:
        inputs = tuple(TensorSpec(n, "INT64", (seq,)) for n in ("input_ids", "attention_mask"))
        outputs = (TensorSpec("embedding", "FP32", (384,)),)
    spec = Workload(f"slo-{workload}-{seq}", workload, inputs, outputs, 1, (),
                    lambda path: Path(shutil.copy(model, path)), dict)  # fmt: skip
    served = WORK / "models" / spec.name / "model.onnx"
    served.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(model, served)  # always the file given, not one from an earlier run
    running: dict[str, tuple[str, object]] = {}
    for w in windows:
        r = servers.start(servers.PEERS["pytriton"], spec, work, max_wait_ms=w / 1000)
        running[f"triton-w{w}"] = (r.url(workload), r)
    return running


def _only(active: str, triton: dict[str, tuple[str, object]]) -> None:
    """Freeze (SIGSTOP) every Triton server but ``active``'s, whose processes run on: an idle
    PyTriton keeps a core busy polling (~12% each here), which would be taken from whichever
    configuration is measured."""
    for label, (_, handle) in triton.items():
        pgid = handle.server.pid  # type: ignore[attr-defined]  # its own session
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT if label == active else signal.SIGSTOP)


def _taskset(cpus: str) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


# ---------------------------------------------------------------------------- one point
def _point(
    url: str, model: str, body: Path, rate: float, seconds: float, clients: int,
    cpus: str, work: Path, seed: int, conns: int = 1024, loadgen: str = "python",
) -> dict:  # fmt: skip
    """Offer ``rate`` requests/s to ``url`` for ``seconds``; ``model`` labels the row.
    ``loadgen``: the suite's Python client (``bench.clients.openloop``) or its C twin
    (``bench/clients/openloop.c``: the same measurement at ~1/3 of the client CPU)."""
    procs = []
    for k in range(clients):
        result = work / f"client-{k}.json"
        result.unlink(missing_ok=True)
        if loadgen == "c":
            host_port, path = url.split("/", 3)[2], "/" + url.split("/", 3)[3]
            host, port = host_port.split(":")
            request = work / f"request-{k}.http"
            request.write_bytes(openloop.post_request(host, int(port), path, body.read_bytes()))
            cmd = openloop_c.command(host, int(port), request, rate / clients, seconds,
                                     seed * 100 + k + 1, conns, 5.0, result)  # fmt: skip
        else:
            cmd = openloop.command(
                url, body, rate / clients, seconds, seed * 100 + k, conns, 5.0, result
            )
        cmd = [*_taskset(cpus), *cmd]
        procs.append((subprocess.Popen(cmd, cwd=ROOT), result))
    codes: dict[str, int] = {}
    lat: list[float] = []
    scheduled = unfinished = 0
    elapsed = lag = 0.0
    for p, result in procs:
        p.wait(seconds + 60)
        r = json.loads(result.read_text())
        elapsed = max(elapsed, r["elapsed"])
        lag = max(lag, r["lag_p99_ms"])
        scheduled += r["scheduled"]
        unfinished += r["unfinished"]
        lat += r["latency_ms"]
        for c, n in r["codes"].items():
            codes[c] = codes.get(c, 0) + n
    arr = np.asarray(lat)
    return {
        "model": model,
        "offered": rate,
        "scheduled": scheduled,
        "ok": int(arr.size),
        "codes": codes,
        "unfinished": unfinished,
        "elapsed": elapsed,
        "client_lag_p99_ms": lag,
        "latencies": arr,
        "p50_ms": float(np.percentile(arr, 50)) if arr.size else float("nan"),
        "p99_ms": float(np.percentile(arr, 99)) if arr.size else float("nan"),
    }


def _server_state(port: int, model: str, objective_ms: float) -> dict[str, float]:
    """One rtserve configuration's counters from /metrics: its answers within the objective
    as the server timed them (reception to encoded answer; the histogram bucket at the
    objective, or the largest below it), all its answers, and for ``slo`` the controller's
    budget factor and the batches run so far (count and rows)."""
    from rtserve.observability.metrics import LATENCY_BUCKETS

    bound = max((b for b in LATENCY_BUCKETS if b <= objective_ms / 1e3 + 1e-12), default=0.0)
    out = {"within": 0.0, "answered": 0.0}
    for name, labels, value in procs.metrics(f"http://127.0.0.1:{port}"):
        if labels.get("model") != model:
            continue
        if name == "rtserve_request_duration_seconds_bucket":
            if labels["le"] == "+Inf":
                out["answered"] = value
            elif abs(float(labels["le"]) - bound) < 1e-12:
                out["within"] = value
        elif name in (
            "rtserve_slo_budget_factor",
            "rtserve_batch_size_sum",
            "rtserve_batch_size_count",
        ):
            out[name] = value
    return out


def _post_once(url: str, body: bytes, timeout_s: float) -> tuple[int, float]:
    """One JSON POST: (status, seconds it took)."""
    t0 = time.perf_counter()
    return procs.http_post(url, body, timeout_s)[0], time.perf_counter() - t0


def _closed_loop(url: str, body: bytes, conns: int, seconds: float, cpus: str, work: Path) -> float:
    """Answers (2xx) per second under ``conns`` closed-loop wrk connections (one thread)."""
    script = work / "closed.lua"
    script.write_text(lua_script(body))
    m = wrk.measure(url, script, conns, seconds, Measurement("", "", "wrk", "closed", conns),
                    prefix=_taskset(cpus))  # fmt: skip
    if m.error or not m.requests:
        raise RuntimeError(f"wrk: {m.error or 'no request'}")
    return (m.requests - m.errors) / m.requests * (m.rps or 0.0)


def _idle_latency(url: str, body: bytes, count: int = 7) -> float:
    """The median time one request takes with nothing else running (seconds)."""
    return float(np.median([_post_once(url, body, 30.0)[1] for _ in range(count)]))


def _quiesce(url: str, body: bytes, threshold_s: float, timeout_s: float = 180.0) -> float:
    """Wait until ``url`` answers one request within ``threshold_s`` twice in a row: the
    backlog an overloaded configuration still holds (servers keep computing requests whose
    clients gave up) must not take the CPU from the next point. Returns the seconds waited."""
    started = time.monotonic()
    fast = 0
    while fast < 2 and time.monotonic() - started < timeout_s:
        try:
            status, took = _post_once(url, body, timeout_s)
        except OSError:
            status, took = 0, timeout_s
        fast = fast + 1 if status == 200 and took <= threshold_s else 0
        if not fast:
            time.sleep(0.2)
    return time.monotonic() - started


# ---------------------------------------------------------------------------- report
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    add("--closed-loop", type=int, default=0, help="capacity from wrk with this many connections")
    add("--clients", type=int, default=2, help="client processes")
    add("--conns", type=int, default=1024, help="most connections per client process")
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
    _stop_on_sigterm()
    started = time.monotonic()
    objective = args.objective_ms
    windows = [int(w) for w in args.windows.split(",") if w]
    loads = [float(x) for x in args.loads.split(",")]
    work = Path(tempfile.mkdtemp(prefix="slo-bench-"))
    repo = work / "repo"
    model_file = _model_file(args.workload)
    models = _repository(repo, model_file, objective, windows, args.max_batch)
    body = work / "body.json"
    body.write_bytes(_request_body(args.workload, args.seq))
    server, ports = procs.rtserve(
        work, "--model-repository", str(repo), cpus=args.server_cpus, src=args.src
    )
    port = ports["http_port"]
    urls = {m: f"http://127.0.0.1:{port}/v2/models/{m}/infer" for m in models}
    triton: dict[str, tuple[str, object]] = {}
    try:
        tw = [int(w) for w in args.triton_windows.split(",") if w]
        triton = _pytriton(args.workload, model_file, args.seq, tw, work)
        urls.update({label: url for label, (url, _) in triton.items()})
        models = list(urls)
        # Drained: one request answered within half the objective, or within twice the time
        # it takes on the idle configuration where that is longer (PyTriton on the MLP).
        settled = {}
        for m in models:
            _only(m, triton)
            settled[m] = max(objective / 2e3, 2 * _idle_latency(urls[m], body.read_bytes()))
        # Capacity: the most answers per second any configuration gives under heavy overload
        # (open loop), or to --closed-loop connections that each wait for their answer.
        probe = []
        for m in models if not (args.closed_loop or args.capacity) else []:
            _only(m, triton)
            probe.append(_point(urls[m], m, body, args.probe_rate, 2, args.clients, args.client_cpus,
                                work, 99, args.conns, args.loadgen))  # fmt: skip
            _quiesce(urls[m], body.read_bytes(), settled[m])
        closed = [
            _closed_loop(urls[m], body.read_bytes(), args.closed_loop, 3, args.client_cpus, work)
            for m in models
            if args.closed_loop and not args.capacity
        ]
        capacity = args.capacity or max([p["ok"] / p["elapsed"] for p in probe] + closed)
        print(f"capacity ~{capacity:.0f} answers/s", flush=True)
        rows = []
        for i, load in enumerate(loads):
            for m in rotated(models, i):
                rows.append(
                    _load_point(args, m, load, i, capacity, urls, body, port, settled, triton, work)
                )
    finally:
        for label in triton:
            _only(label, {label: triton[label]})  # running again, so that it can stop
        for _, handle in triton.values():
            servers.stop(handle)  # type: ignore[arg-type]
        server.stop(grace_s=30)
    if args.out is not None:
        _write(args, rows, models, capacity, objective, time.monotonic() - started)


def _load_point(
    args: argparse.Namespace,
    m: str,
    load: float,
    i: int,
    capacity: float,
    urls: dict[str, str],
    body: Path,
    port: int,
    settled: dict[str, float],
    triton: dict[str, tuple[str, object]],
    work: Path,
) -> dict[str, Any]:
    """One configuration at one offered load: goodput, latencies and the server's counters."""
    objective = args.objective_ms
    _only(m, triton)
    rtserve = not m.startswith("triton")
    before = _server_state(port, m, objective) if rtserve else {}
    r = _point(
        urls[m], m, body, load * capacity, args.seconds, args.clients,
        args.client_cpus, work, i, args.conns, args.loadgen,
    )  # fmt: skip
    r["drained_s"] = _quiesce(urls[m], body.read_bytes(), settled[m])
    if rtserve:
        after = _server_state(port, m, objective)
        answered = after["answered"] - before["answered"]
        within = after["within"] - before["within"]
        r["server_within"] = within / answered if answered else float("nan")
    if m == "slo":
        n = after["rtserve_batch_size_count"] - before["rtserve_batch_size_count"]
        rows_run = after["rtserve_batch_size_sum"] - before["rtserve_batch_size_sum"]
        r["slo_factor"] = after["rtserve_slo_budget_factor"]
        r["slo_batch_rows"] = rows_run / max(1.0, n)
    good = int((r["latencies"] <= objective).sum())
    r["load"] = load
    r["goodput"] = good / args.seconds
    print(
        f"load {load:>4}x {m:>6}: goodput {r['goodput']:8.0f}/s  ok {r['ok']:6d}  "
        f"p99 {r['p99_ms']:8.2f} ms  codes {r['codes']}  lost {r['unfinished']}  "
        f"client lag p99 {r['client_lag_p99_ms']:.1f} ms  drained {r['drained_s']:.1f} s"
        + (
            f"  factor {r['slo_factor']:.2f}  batch {r['slo_batch_rows']:.1f}" if m == "slo" else ""
        ),
        flush=True,
    )
    return r


def _stop_on_sigterm() -> None:
    """A SIGTERM (``timeout``, a kill by PID) ends the run as Ctrl-C does: the ``finally``
    blocks stop the servers it started, frozen Triton servers included, instead of leaving
    them behind."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _combine(paths: list[Path], objective: float) -> list[str]:
    """Rounds side by side: per load, each round's SLO goodput over the best other
    configuration's (fixed windows and Triton), their median, and each round's SLO p99."""
    rounds = [json.loads(p.read_text()) for p in paths]
    loads = sorted({r["load"] for rows in rounds for r in rows})
    table = []
    for load in loads:
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


def _best(rows: list[dict], labels: list[str]) -> dict | None:
    return max((r for r in rows if r["model"] in labels), key=lambda r: r["goodput"], default=None)


def _plot(rows: list[dict], models: list[str], objective: float, path: Path, title: str) -> None:
    from bench.plots import plt, save

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in models:
        pts = sorted((r for r in rows if r["model"] == m), key=lambda r: r["load"])
        style: dict = {"marker": "o", "markersize": 4}
        if m == "slo":
            style = {"marker": "o", "linewidth": 2.6, "color": "black", "zorder": 5}
        elif m.startswith("triton"):
            style = {"marker": "s", "markersize": 4, "linestyle": "--"}
        label = {"slo": "rtserve SLO controller"}.get(m, m)
        if m.startswith("w"):
            label = f"rtserve fixed {m}"
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


def _share(x: float | None) -> str:
    return "-" if x is None or x != x else f"{100 * x:.2f}%"


def _write(args, rows, models, capacity, objective, took) -> None:  # type: ignore[no-untyped-def]
    fixed = [m for m in models if m.startswith("w")]
    triton = [m for m in models if m.startswith("triton")]
    what = f"{args.workload}" + (f" seq {args.seq}" if args.workload == "minilm" else "")
    how = ("given" if args.capacity else f"measured first, closed loop, wrk -c{args.closed_loop}"
           if args.closed_loop else "measured first, the best configuration under heavy overload")  # fmt: skip
    pins = (f", pinned to CPUs {args.client_cpus}" if args.client_cpus else "") + (
        f"; server pinned to CPUs {args.server_cpus}" if args.server_cpus else "")  # fmt: skip
    header = [
        "load",
        "SLO goodput/s",
        "SLO p99 ms",
        "SLO refused",
        "best fixed",
        "goodput/s",
        "p99 ms",
    ]
    header += ["best Triton", "goodput/s", "p99 ms"] if triton else []
    table = []
    for load in sorted({r["load"] for r in rows}):
        at = [r for r in rows if r["load"] == load]
        s = next(r for r in at if r["model"] == "slo")
        best = [_best(at, fixed), *([_best(at, triton)] if triton else [])]
        others = [x["goodput"] for x in best if x is not None]
        row = [
            f"{load:g}x",
            f"{s['goodput']:.0f}",
            f"{s['p99_ms']:.1f}",
            str(s["codes"].get("429", 0)),
        ]
        for x in best:
            row += (
                ["-"] * 3
                if x is None
                else [x["model"], f"{x['goodput']:.0f}", f"{x['p99_ms']:.1f}"]
            )
        ratio = s["goodput"] / max(others) if others and max(others) > 0 else float("inf")
        table.append([*row, f"{ratio:.2f}"])
    points = [[f"{r['load']:g}x", r["model"], f"{r['goodput']:.0f}", str(r["ok"]), f"{r['p50_ms']:.2f}",
               f"{r['p99_ms']:.2f}", str(r["codes"]), str(r["unfinished"]), f"{r['client_lag_p99_ms']:.1f}",
               _share(r.get("server_within")),
               f"{r['slo_factor']:.2f}, {r['slo_batch_rows']:.1f}" if "slo_factor" in r else ""]
              for r in rows]  # fmt: skip
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
        "Every point (`lost`: unanswered 5 s after the last send; `client lag`: p99 of how late the "
        "client sent; `server-timed`: share of rtserve's answers within the objective by its own "
        "latency histogram):", "",
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
