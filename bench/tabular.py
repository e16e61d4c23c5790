"""Tabular workload: a 500-tree depth-8 XGBoost binary classifier on 30 features and a
LightGBM of the same size, served by rtserve (each execution choice), MLServer
(mlserver-xgboost / mlserver-lightgbm, in bench/.peers/mlserver), a naive FastAPI +
``predict_proba`` server, with the framework's own one-row predict in-process as the floor.

Per server and model: rows/s at capacity (wrk, closed loop, one row per request), then
p50/p99 at half of that rate (the C open-loop client: Poisson arrivals, latency from each
scheduled send). Rounds alternate the servers. ``python -m bench.tabular --rounds 3``.
``--direct-ab``: a second rtserve with direct runs on (``RTSERVE_DIRECT_MAX_US=200``: an idle
batcher runs a cheap model's request on arrival, see scheduling/batcher.py), measured in
the same rounds as "rtserve-direct". ``--workers-ab``: also an rtserve with ``--workers 2``
("rtserve-w2"). ``--pin``: every server on CPU 0 and the load generators on CPU 1 (the load
then does not take the server's core, as from another machine; with two CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import procs
from bench.clients import openloop, openloop_c, wrk
from bench.results import Measurement

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work" / "tabular"
MLSERVER = ROOT / "bench" / ".peers" / "mlserver" / "bin" / "mlserver"
FEATURES = 30
TREES = 500
DEPTH = 8


# Execution choices measured per framework (runtime/tree_engines.py).
EXECUTIONS = {
    "xgboost": ("native", "treelite", "onnx"),
    "lightgbm": ("native", "treelite"),  # lleaves: its LLVM build of this model ran > 8 min
}


def build_models(out: Path) -> np.ndarray:
    """The two models (built once; cached under ``out``) and rows to send."""
    import lightgbm as lgb
    import xgboost as xgb
    from sklearn.datasets import make_classification

    x, y = make_classification(20000, FEATURES, n_informative=15, random_state=0)
    x = x.astype(np.float32)
    xj, lj = out / "model.json", out / "model.txt"
    if not xj.exists():
        clf = xgb.XGBClassifier(n_estimators=TREES, max_depth=DEPTH, n_jobs=2, tree_method="hist")
        clf.fit(x, y)
        clf.save_model(xj)
    if not lj.exists():
        lgbm = lgb.LGBMClassifier(
            n_estimators=TREES, max_depth=DEPTH, num_leaves=2**DEPTH - 1, n_jobs=2, verbose=-1
        )
        lgbm.fit(x, y)
        lgbm.booster_.save_model(lj)
    return x[:100]


def rtserve_repo(out: Path, models: Path) -> list[str]:
    names = []
    for fw, file in (("xgboost", "model.json"), ("lightgbm", "model.txt")):
        execs = EXECUTIONS[fw]
        for ex in execs:
            name = f"{'xgb' if fw == 'xgboost' else 'lgb'}-{ex}"
            d = out / name / "1"
            d.mkdir(parents=True, exist_ok=True)
            target = d / file
            if not target.exists():
                target.symlink_to(models / file)
            (out / name / "config.yaml").write_text(
                f"backend: {fw}\n{fw}: {{execution: {ex}, outputs: [predict_proba]}}\n"
            )
            names.append(name)
    return names


def mlserver_repo(out: Path, models: Path, port: int) -> None:
    for name, impl, file in (
        ("xgb", "mlserver_xgboost.XGBoostModel", "model.json"),
        ("lgb", "mlserver_lightgbm.LightGBMModel", "model.txt"),
    ):
        (out / name).mkdir(parents=True, exist_ok=True)
        settings = {"name": name, "implementation": impl, "parameters": {"uri": str(models / file)}}
        (out / name / "model-settings.json").write_text(json.dumps(settings))
    ports = {"http_port": port, "grpc_port": procs.free_port(), "metrics_port": procs.free_port()}
    (out / "settings.json").write_text(json.dumps({**ports, "parallel_workers": 0}))


FASTAPI_APP = """
import numpy as np, xgboost as xgb, lightgbm as lgb
from fastapi import FastAPI, Request
app = FastAPI()
xm = xgb.XGBClassifier(); xm.load_model("{models}/model.json")
lm = lgb.Booster(model_file="{models}/model.txt")
@app.post("/xgb")
async def px(req: Request):
    rows = np.asarray((await req.json())["rows"], dtype=np.float32)
    return {{"proba": xm.predict_proba(rows).tolist()}}
@app.post("/lgb")
async def pl(req: Request):
    rows = np.asarray((await req.json())["rows"], dtype=np.float32)
    p = lm.predict(rows)
    return {{"proba": np.stack([1 - p, p], axis=1).tolist()}}
"""


def v2_body(row: np.ndarray, datatype: str) -> bytes:
    return json.dumps({"inputs": [{"name": "features" if datatype else "input-0",
                                   "datatype": datatype or "FP32", "shape": [1, FEATURES],
                                   "data": row.tolist()}]}).encode()  # fmt: skip


def capacity(url: str, body: bytes, seconds: float, conns: int = 4) -> Measurement:
    script = WORK / f"wrk-{abs(hash(url))}.lua"
    script.write_text(wrk.lua_script(body))
    return wrk.measure(
        url, script, conns, seconds, Measurement("", "tabular", "wrk", "closed", conns)
    )


def half_load(url: str, body: bytes, rate: float, seconds: float) -> dict[str, float]:
    """p50/p99 (ms) of one-row requests offered at ``rate``/s, open loop."""
    host, port, path = url.split("/")[2].split(":") + ["/" + url.split("/", 3)[3]]
    req = WORK / f"req-{abs(hash(url))}.http"
    req.write_bytes(openloop.post_request(host, int(port), path, body))
    result = WORK / "openloop.json"
    result.unlink(missing_ok=True)
    cmd = openloop_c.command(host, int(port), req, rate, seconds, 1, 8, 2.0, result)
    subprocess.run(cmd, capture_output=True, timeout=seconds + 60, check=False)
    data = json.loads(result.read_text())
    lat = sorted(data.get("latency_ms") or [float("nan")])
    return {"p50_ms": lat[len(lat) // 2], "p99_ms": lat[int(len(lat) * 0.99)],
            "errors": data.get("errors", 0)}  # fmt: skip


def in_process(models: Path, rows: np.ndarray) -> dict[str, float]:
    """us per one-row call: the framework's own predict, and rtserve's runtime (each
    execution), without a server."""
    import lightgbm as lgb
    import xgboost as xgb

    from rtserve.config import parse_model_config
    from rtserve.runtime import trees

    def per_call(fn: Any, n: int = 2000) -> float:
        for r in rows[:20]:
            fn(r[None, :])
        times = []
        for i in range(n):
            r = rows[i % len(rows)][None, :]
            t = time.perf_counter_ns()
            fn(r)
            times.append(time.perf_counter_ns() - t)
        return statistics.median(times) / 1e3

    out: dict[str, float] = {}
    b = xgb.Booster()
    b.load_model(str(models / "model.json"))
    b.set_param({"nthread": 1})
    out["xgboost inplace_predict"] = per_call(lambda r: b.inplace_predict(r))
    clf = xgb.XGBClassifier()
    clf.load_model(models / "model.json")
    clf.set_params(n_jobs=1)
    out["xgboost predict_proba"] = per_call(lambda r: clf.predict_proba(r))
    lb = lgb.Booster(model_file=str(models / "model.txt"))
    out["lightgbm predict"] = per_call(lambda r: lb.predict(r, num_threads=1))
    for fw, file in (("xgboost", "model.json"), ("lightgbm", "model.txt")):
        with tempfile.TemporaryDirectory() as tmp:
            for ex in EXECUTIONS[fw]:
                (Path(tmp) / file).unlink(missing_ok=True)
                (Path(tmp) / file).symlink_to(models / file)
                cfg = parse_model_config(
                    {"backend": fw, fw: {"execution": ex, "outputs": ["predict_proba"]}}, "m", "m"
                )
                m = trees.load(cfg, Path(tmp))
                dt = m.dtype
                out[f"rtserve {fw} {ex}"] = per_call(
                    lambda r, m=m, dt=dt: m.run(0, {"features": r.astype(dt)})
                )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tabular.json")
    ap.add_argument(
        "--direct-ab",
        action="store_true",
        help="also an rtserve with direct runs on (RTSERVE_DIRECT_MAX_US=200)",
    )
    ap.add_argument(
        "--workers-ab", action="store_true", help="also an rtserve with --workers 2 (rtserve-w2)"
    )
    ap.add_argument("--pin", action="store_true",
                    help="servers on CPU 0, load generators on CPU 1")  # fmt: skip
    args = ap.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    models = WORK / "models"
    models.mkdir(exist_ok=True)
    t = time.time()
    rows = build_models(models)
    print(f"models ready in {time.time() - t:.0f} s", flush=True)
    floor = in_process(models, rows)  # (also compiles the treelite libraries, cached)
    for k, v in floor.items():
        print(f"in-process {k}: {v:.1f} us/row", flush=True)

    repo = WORK / "rtserve-repo"
    names = rtserve_repo(repo, models)
    row = rows[0]
    targets: dict[str, tuple[str, bytes]] = {}
    servers: list[procs.Server] = []
    bases: dict[str, str] = {}
    try:
        pin = ["taskset", "-c", "0"] if args.pin else []
        variants: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {"rtserve": ({}, ())}
        if args.direct_ab:
            variants["rtserve-direct"] = ({"RTSERVE_DIRECT_MAX_US": "200"}, ())
        if args.workers_ab:
            variants["rtserve-w2"] = ({}, ("--workers", "2"))
        for label, (env, extra) in variants.items():
            server, ports = procs.rtserve(WORK / label, "--model-repository", str(repo),
                                          *extra, env=env, cpus="0" if args.pin else "")  # fmt: skip
            servers.append(server)
            bases[label] = f"http://127.0.0.1:{ports['http_port']}"
            server.wait_ready(bases[label] + "/v2/health/ready", 900)
        for n in names:
            body = v2_body(row, "FP32" if n.startswith("xgb") else "FP64")
            for label, base in bases.items():
                targets[f"{label} {n}"] = (f"{base}/v2/models/{n}/infer", body)
        (WORK / "naive_fastapi_tabular.py").write_text(FASTAPI_APP.format(models=models))
        port = procs.free_port()
        argv = [*pin, sys.executable, "-m", "uvicorn", "naive_fastapi_tabular:app", "--port",
                str(port), "--log-level", "warning", "--app-dir", str(WORK)]  # fmt: skip
        servers.append(procs.Server("fastapi", argv, os.environ, WORK / "fastapi.log", ROOT))
        servers[-1].wait_ready(f"http://127.0.0.1:{port}/docs", 900)
        body = json.dumps({"rows": [row.tolist()]}).encode()
        for n in ("xgb", "lgb"):
            targets[f"fastapi {n}"] = (f"http://127.0.0.1:{port}/{n}", body)
        if MLSERVER.exists():
            port, mrepo = procs.free_port(), WORK / "mlserver-repo"
            mlserver_repo(mrepo, models, port)
            argv = [*pin, str(MLSERVER), "start", str(mrepo)]
            servers.append(procs.Server("mlserver", argv, os.environ, WORK / "mlserver.log", ROOT))
            servers[-1].wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", 900)
            for n in ("xgb", "lgb"):
                targets[f"mlserver {n}"] = (
                    f"http://127.0.0.1:{port}/v2/models/{n}/infer",
                    v2_body(row, ""),
                )
        for name, (url, body) in targets.items():  # each answers before it is measured
            assert procs.http_post(url, body)[0] == 200, name
        if args.pin:  # (wrk and the open-loop client inherit it)
            os.sched_setaffinity(0, {1})
        results: dict[str, list[dict[str, float]]] = {k: [] for k in targets}
        for rnd in range(args.rounds):
            order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
            for name in order:
                url, body = targets[name]
                cap = capacity(url, body, args.seconds)
                lat = half_load(url, body, max(1.0, cap.rps / 2), args.seconds)
                results[name].append({"rps": cap.rps, "cap_errors": cap.errors, **lat})
                print(f"round {rnd + 1} {name}: {cap.rps:.0f} rows/s at capacity; at "
                      f"{cap.rps / 2:.0f}/s p50 {lat['p50_ms']:.3f} ms p99 "
                      f"{lat['p99_ms']:.3f} ms", flush=True)  # fmt: skip
    finally:
        for server in servers:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "rounds": args.rounds, "seconds": args.seconds, "pinned": args.pin, "in_process_us": floor,
        "servers": results,
    }, indent=2))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
