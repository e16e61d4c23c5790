"""Tabular workload: a 500-tree depth-8 XGBoost binary classifier on 30 features and a
LightGBM of the same size, served by rtserve (each execution choice), MLServer
(mlserver-xgboost / mlserver-lightgbm, in bench/.peers/mlserver), a naive FastAPI +
``predict_proba`` server, with the framework's own one-row predict in-process as the floor.

Per server and model: rows/s at capacity (wrk, closed loop, one row per request), then
p50/p99 at half of that rate (the C open-loop client: Poisson arrivals, latency from each
scheduled send). Rounds alternate the servers. ``python -m bench.tabular --rounds 3``.
``--direct-ab``: a second rtserve with direct runs on (``RTSERVE_DIRECT_MAX_US=200``: an idle
batcher runs a cheap model's request on arrival, see scheduling/batcher.py), measured in
the same rounds as "rtserve-direct".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from bench.clients import openloop_c, wrk

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


def mlserver_repo(out: Path, models: Path) -> None:
    for name, impl, file in (
        ("xgb", "mlserver_xgboost.XGBoostModel", "model.json"),
        ("lgb", "mlserver_lightgbm.LightGBMModel", "model.txt"),
    ):
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "model-settings.json").write_text(
            json.dumps(
                {"name": name, "implementation": impl, "parameters": {"uri": str(models / file)}}
            )  # fmt: skip
        )
    (out / "settings.json").write_text(
        json.dumps(
            {"http_port": 18080, "grpc_port": 18081, "metrics_port": 18082, "parallel_workers": 0}
        )  # fmt: skip
    )


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


def wait_http(url: str, timeout: float = 900) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not ready within {timeout} s")


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def v2_body(row: np.ndarray, datatype: str) -> bytes:
    return json.dumps({"inputs": [{"name": "features" if datatype else "input-0",
                                   "datatype": datatype or "FP32", "shape": [1, FEATURES],
                                   "data": row.tolist()}]}).encode()  # fmt: skip


def capacity(url: str, body: bytes, seconds: float, conns: int = 4) -> dict[str, float]:
    script = WORK / f"wrk-{abs(hash(url))}.lua"
    script.write_text(wrk.lua_script(body))
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency", "-s",
           str(script), url]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30).stdout
    return wrk.parse(out)


def half_load(url: str, body: bytes, rate: float, seconds: float) -> dict[str, float]:
    """p50/p99 (ms) of one-row requests offered at ``rate``/s, open loop."""
    host_port, path = url.split("//", 1)[1].split("/", 1)
    host, port = host_port.split(":")
    req = WORK / f"req-{abs(hash(url))}.http"
    req.write_bytes(
        f"POST /{path} HTTP/1.1\r\nHost: {host_port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    result = WORK / "openloop.json"
    result.unlink(missing_ok=True)
    cmd = openloop_c.command(host, int(port), req, rate, seconds, 1, 8, 2.0, result)
    subprocess.run(cmd, capture_output=True, timeout=seconds + 60, check=False)
    data = json.loads(result.read_text())
    lat = data.get("latency_ms")
    if isinstance(lat, dict):
        return {"p50_ms": lat.get("p50", float("nan")), "p99_ms": lat.get("p99", float("nan")),
                "errors": data.get("errors", 0)}  # fmt: skip
    lat = sorted(lat or [float("nan")])
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
    ap.add_argument("--no-peers", action="store_true", help="rtserve and the floor only")
    ap.add_argument("--direct-ab", action="store_true",
                    help="also an rtserve with direct runs on (RTSERVE_DIRECT_MAX_US=200)")  # fmt: skip
    ap.add_argument("--models", default="",
                    help="comma-separated rtserve models to measure (e.g. xgb-onnx,lgb-native)")  # fmt: skip
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
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    servers: dict[str, Any] = {}
    ports = WORK / "ports.json"
    ports.unlink(missing_ok=True)

    def serve(port: int) -> list[str]:
        return [sys.executable, "-m", "rtserve.cli", "serve", "--model-repository", str(repo),
                "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "0"]  # fmt: skip

    servers["rtserve"] = start(serve(18000), WORK / "rtserve.log", env)
    if args.models:
        names = [n for n in names if n in args.models.split(",")]
    if args.direct_ab:
        servers["rtserve-direct"] = start(
            serve(18001), WORK / "rtserve-direct.log", dict(env, RTSERVE_DIRECT_MAX_US="200")
        )
    for n in names:
        dt = "FP32" if n.startswith("xgb") else "FP64"
        targets[f"rtserve {n}"] = (f"http://127.0.0.1:18000/v2/models/{n}/infer", v2_body(row, dt))
        if args.direct_ab:
            targets[f"rtserve-direct {n}"] = (
                f"http://127.0.0.1:18001/v2/models/{n}/infer",
                v2_body(row, dt),
            )
    if not args.no_peers:
        app = WORK / "naive_fastapi_tabular.py"
        app.write_text(FASTAPI_APP.format(models=models))
        servers["fastapi"] = start([sys.executable, "-m", "uvicorn", "naive_fastapi_tabular:app",
                                    "--port", "18090", "--log-level", "warning",
                                    "--app-dir", str(WORK)], WORK / "fastapi.log")  # fmt: skip
        body = json.dumps({"rows": [row.tolist()]}).encode()
        targets["fastapi xgb"] = ("http://127.0.0.1:18090/xgb", body)
        targets["fastapi lgb"] = ("http://127.0.0.1:18090/lgb", body)
        if MLSERVER.exists():
            mrepo = WORK / "mlserver-repo"
            mlserver_repo(mrepo, models)
            servers["mlserver"] = start([str(MLSERVER), "start", str(mrepo)], WORK / "mlserver.log")
            for n in ("xgb", "lgb"):
                targets[f"mlserver {n}"] = (
                    f"http://127.0.0.1:18080/v2/models/{n}/infer",
                    v2_body(row, ""),
                )
    try:
        wait_http("http://127.0.0.1:18000/v2/health/ready")
        if "rtserve-direct" in servers:
            wait_http("http://127.0.0.1:18001/v2/health/ready")
        if "fastapi" in servers:
            wait_http("http://127.0.0.1:18090/docs")
        if "mlserver" in servers:
            wait_http("http://127.0.0.1:18080/v2/health/ready")
        for name, (url, body) in targets.items():  # each answers before it is measured
            req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200, name
        results: dict[str, list[dict[str, float]]] = {k: [] for k in targets}
        for rnd in range(args.rounds):
            order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
            for name in order:
                url, body = targets[name]
                cap = capacity(url, body, args.seconds)
                lat = half_load(url, body, max(1.0, cap["rps"] / 2), args.seconds)
                res = {"rps": cap["rps"], "cap_errors": cap["errors"], **lat}
                results[name].append(res)
                print(f"round {rnd + 1} {name}: {cap['rps']:.0f} rows/s at capacity; at "
                      f"{cap['rps'] / 2:.0f}/s p50 {lat['p50_ms']:.3f} ms p99 "
                      f"{lat['p99_ms']:.3f} ms", flush=True)  # fmt: skip
    finally:
        for p in servers.values():
            stop(p)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "rounds": args.rounds, "seconds": args.seconds, "in_process_us": floor,
        "servers": results,
    }, indent=2))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
