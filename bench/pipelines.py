"""The pipeline benchmark: ``text-embedding`` end to end, sentences in, embeddings out.

    python -m bench.pipelines [--seconds 15] [--rounds 2] [--out docs/benchmarks-pipelines.md]

Servers, one at a time, each bound to 127.0.0.1 and loaded by wrk (-t1 -c32) with sentences
from examples/data/sentences.txt, rotated per request:
- rtserve serving the bundled ``text-embedding`` ensemble (examples/repository, ``make
  examples``): the Python tokenizer step (thread isolation, and again with process
  isolation), then MiniLM INT8 through its own batcher (2 instances sharing the threads, as
  shipped; and 1 instance with all of them);
- the same pipeline (same tokenizer.json, same INT8 ONNX file, same ONNX Runtime threads)
  written as a user of each library would: naive FastAPI (tokenize + run per request),
  LitServe and BentoML (their batching, max 32, 1 ms wait), from bench/peers/text_*.py in
  the peers' own venvs (bench/.peers, with ``tokenizers`` added).
Then the Python step alone: rtserve serving only the tokenizer model, thread vs process
isolation, with the server's CPU time per request; and what the ensemble layer itself costs:
a tiny ONNX model called directly and through a one-step ensemble.

Rounds alternate the order of the servers; the report shows every round and the median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench import envs, machine
from bench.clients import wrk
from bench.procs import Server, cpu_seconds, descendants, free_port, http_post
from bench.workloads import ROOT, WORK

EXAMPLES = ROOT / "examples" / "repository"
SENTENCES = ROOT / "examples" / "data" / "sentences.txt"
OUT = WORK / "pipelines"
CONNECTIONS = 32
INTRA_OP_THREADS = 2  # ONNX Runtime intra-op threads of every server's model (--threads)
MAX_BATCH = 32
MAX_WAIT_MS = 1.0
PIPELINE_MODELS = ("minilm-tokenizer", "minilm-int8", "text-embedding")


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    env: str  # "main" or a peer venv under bench/.peers
    path: str  # the infer route
    health: str
    body_kind: str  # how a sentence becomes a request body


CONTENDERS = {
    c.name: c
    for c in (
        Contender("rtserve", "rtserve (ensemble as shipped: MiniLM 2 instances; tokenizer thread)",
                  "main", "/v2/models/text-embedding/infer", "/v2/models/text-embedding/ready",
                  "v2"),
        Contender("rtserve_process", "rtserve (same, tokenizer in a worker process)", "main",
                  "/v2/models/text-embedding/infer", "/v2/models/text-embedding/ready", "v2"),
        Contender("rtserve_one_instance", "rtserve (MiniLM 1 instance with all the threads)",
                  "main", "/v2/models/text-embedding/infer", "/v2/models/text-embedding/ready",
                  "v2"),
        Contender("fastapi", "naive FastAPI (tokenize + ORT per request)", "fastapi",
                  "/embed", "/health", "text"),
        Contender("litserve", "LitServe (batch 32, 1 ms)", "litserve", "/embed", "/health",
                  "text"),
        Contender("bentoml", "BentoML (batchable, 32)", "bentoml", "/embed", "/readyz", "texts"),
    )
}  # fmt: skip


@dataclass
class Point:
    name: str
    label: str
    round: int
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    errors: int = 0
    requests: int = 0
    cpu_ms_per_request: float = 0.0
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def sentences() -> list[str]:
    lines = SENTENCES.read_text().splitlines()
    return [s.strip() for s in lines if s.strip() and not s.startswith("#")]


def body(kind: str, sentence: str) -> bytes:
    if kind == "v2":
        doc: dict[str, Any] = {
            "inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [sentence]}]
        }
    elif kind == "tokenizer":
        doc = {
            "inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [sentence]}]
        }
    elif kind == "texts":
        doc = {"texts": [sentence]}
    else:
        doc = {"text": sentence}
    return json.dumps(doc).encode()


def rotating_script(bodies: list[bytes], path: Path) -> Path:
    """A wrk script that POSTs the bodies in turn and prints exact percentiles."""
    text = "".join(b.decode() for b in bodies)
    level = 1
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    items = ",\n".join(f"[{eq}[{b.decode()}]{eq}]" for b in bodies)
    path.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"local bodies = {{\n{items}\n}}\n"
        "local i = 0\n"
        "request = function()\n"
        "  i = i + 1\n"
        "  return wrk.format(nil, nil, nil, bodies[(i % #bodies) + 1])\n"
        "end\n" + wrk._DONE_HOOK
    )
    return path


# ---------------------------------------------------------------------- servers
def _rtserve_repository(
    workdir: Path, isolation: str, models: tuple[str, ...], instances: int = 2
) -> Path:
    """The example's models, with the tokenizer's isolation; ``instances`` MiniLM instances
    share the benchmark's ONNX Runtime threads (the same total as every peer's)."""
    repo = workdir / "repository"
    if repo.exists():
        shutil.rmtree(repo)
    for name in models:
        shutil.copytree(EXAMPLES / name, repo / name)
    for name in models:
        path = repo / name / "config.yaml"
        config = yaml.safe_load(path.read_text())
        if name == "minilm-int8":
            threads = max(1, INTRA_OP_THREADS // instances)
            config.setdefault("onnxruntime", {})["intra_op_threads"] = threads
            config["instance_count"] = instances
        if name == "minilm-tokenizer":
            config["python"] = {"isolation": isolation}
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    return repo


def _peer_env(name: str) -> Path:
    """The peer's venv (installed once by bench.envs), with ``tokenizers`` added."""
    env = envs.ensure(name)
    check = subprocess.run([str(env.python), "-c", "import tokenizers"], capture_output=True)
    if check.returncode != 0:
        subprocess.run(
            [str(env.python), "-m", "pip", "install", "-q", "tokenizers"], check=True, timeout=600
        )
    return env.path


def start(name: str, workdir: Path, log_dir: Path, models: tuple[str, ...] = PIPELINE_MODELS
          ) -> tuple[Server, int]:  # fmt: skip
    """Start one server; return it and its HTTP port once its health route answers 200."""
    contender = CONTENDERS.get(name)
    port = free_port()
    base_env = {
        k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    }
    if name.startswith("rtserve"):
        isolation = "process" if name.endswith("process") else "thread"
        instances = 1 if name.endswith("one_instance") else 2
        repo = _rtserve_repository(workdir, isolation, models, instances)
        venv = envs.MAIN_VENV
        argv = [
            str(venv / "bin" / "python"), "-m", "rtserve.cli", "serve",
            "--model-repository", str(repo), "--host", "127.0.0.1",
            "--http-port", str(port), "--grpc-port", str(free_port()),
        ]  # fmt: skip
        env = dict(base_env, PYTHONPATH=str(ROOT / "src"))
        health = f"/v2/models/{models[-1]}/ready"
    else:
        assert contender is not None
        venv = _peer_env(contender.env)
        settings = {
            "host": "127.0.0.1",
            "port": port,
            "model_path": str(EXAMPLES / "minilm-int8" / "1" / "model.onnx"),
            "tokenizer_path": str(EXAMPLES / "minilm-tokenizer" / "1" / "tokenizer.json"),
            "intra_op_threads": INTRA_OP_THREADS,
            "max_batch_size": MAX_BATCH,
            "max_wait_ms": MAX_WAIT_MS,
        }
        env = dict(base_env, BENCH_TEXT=json.dumps(settings), PYTHONPATH=str(ROOT))
        if name == "bentoml":
            env.update(BENTOML_DO_NOT_TRACK="True", BENTOML_HOME=str(workdir / "bentoml_home"))
            argv = [str(venv / "bin" / "bentoml"), "serve", "bench.peers.text_bentoml:TextEmbedding",
                    "--host", "127.0.0.1", "--port", str(port), "--working-dir", str(ROOT)]  # fmt: skip
        else:
            argv = [str(venv / "bin" / "python"), "-m", f"bench.peers.text_{name}"]
        health = contender.health
    env.update(
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        OMP_NUM_THREADS=str(INTRA_OP_THREADS),
        PYTHONUNBUFFERED="1",
    )
    server = Server(name, argv, env, log_dir / f"{name}.log", cwd=ROOT)
    try:
        server.wait_ready(f"http://127.0.0.1:{port}{health}", 120.0)
    except RuntimeError:
        server.stop()
        raise
    return server, port


def _tree_cpu(pid: int) -> float:
    return sum(cpu_seconds(p) for p in [pid, *descendants(pid)])


def embedding_of(name: str, port: int, sentence: str) -> np.ndarray:
    """One request's embedding, whatever the server's answer format."""
    kind = CONTENDERS[name].body_kind
    status, raw = http_post(f"http://127.0.0.1:{port}{CONTENDERS[name].path}", body(kind, sentence))
    if status != 200:
        raise RuntimeError(f"{name}: HTTP {status}: {raw[:300]!r}")
    doc = json.loads(raw)
    if kind == "v2":
        return np.asarray(doc["outputs"][0]["data"], dtype=np.float32)
    if kind == "texts":
        return np.asarray(doc[0], dtype=np.float32)
    return np.asarray(doc["embedding"], dtype=np.float32)


def load(url: str, bodies: list[bytes], seconds: float, workdir: Path, point: Point,
         pid: int) -> Point:  # fmt: skip
    script = rotating_script(bodies, workdir / "load.lua")
    from bench.results import Measurement

    wrk.measure(url, script, CONNECTIONS, 3.0,
                Measurement("warmup", "pipeline", "wrk", "closed", CONNECTIONS))  # fmt: skip
    before = _tree_cpu(pid)
    m = wrk.measure(url, script, CONNECTIONS, seconds,
                    Measurement(point.name, "pipeline", "wrk", "closed", CONNECTIONS))  # fmt: skip
    used = _tree_cpu(pid) - before
    if m.error:
        point.error = m.error
        return point
    point.rps, point.p50_ms, point.p99_ms = m.rps or 0.0, m.p50_ms or 0.0, m.p99_ms or 0.0
    point.errors, point.requests = m.errors or 0, m.requests or 0
    point.cpu_ms_per_request = used * 1000 / point.requests if point.requests else 0.0
    point.extra["command"] = m.extra.get("command", "")
    return point


def run_contender(name: str, round_no: int, seconds: float, log_dir: Path,
                  reference: np.ndarray | None, texts: list[str]) -> Point:  # fmt: skip
    contender = CONTENDERS[name]
    point = Point(name, contender.label, round_no)
    workdir = OUT / name
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        server, port = start(name, workdir, log_dir)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot start is a row, not a crash
        point.error = f"start failed: {exc}"[:300]
        return point
    try:
        emb = embedding_of(name, port, texts[0])
        point.extra["norm"] = float(np.linalg.norm(emb))
        if reference is not None:
            point.extra["cosine_to_rtserve"] = float(emb @ reference)
        bodies = [body(contender.body_kind, s) for s in texts]
        load(f"http://127.0.0.1:{port}{contender.path}", bodies, seconds, workdir, point,
             server.pid)  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        point.error = str(exc)[:300]
    finally:
        server.stop()
    return point


def run_tokenizer_alone(isolation: str, seconds: float, log_dir: Path, texts: list[str]) -> Point:
    name = f"tokenizer_{isolation}"
    point = Point(name, f"tokenizer step alone ({isolation})", 0)
    workdir = OUT / name
    workdir.mkdir(parents=True, exist_ok=True)
    server, port = start(
        "rtserve_process" if isolation == "process" else "rtserve", workdir, log_dir,
        models=("minilm-tokenizer",),
    )  # fmt: skip
    try:
        bodies = [body("tokenizer", s) for s in texts]
        load(f"http://127.0.0.1:{port}/v2/models/minilm-tokenizer/infer", bodies, seconds,
             workdir, point, server.pid)  # fmt: skip
    finally:
        server.stop()
    return point


# ---------------------------------------------------------------------- ensemble overhead
def _overhead_repository(workdir: Path) -> Path:
    """A tiny ONNX model (y = 2x, FP32 [batch, 4]) and a one-step ensemble around it."""
    import onnx
    from onnx import TensorProto, helper

    repo = workdir / "repository"
    if repo.exists():
        shutil.rmtree(repo)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("k", TensorProto.FLOAT, [], [2.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "double" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "double" / "1" / "model.onnx"))
    (repo / "double" / "config.yaml").write_text(
        "max_batch_size: 32\ndynamic_batching: {max_queue_delay_us: 200}\n"
    )
    (repo / "single" / "1").mkdir(parents=True)
    ensemble = {
        "backend": "ensemble",
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [4]}],
        "steps": [{"model": "double", "inputs": {"x": "X"}, "outputs": {"y": "Y"}}],
    }
    (repo / "single" / "config.yaml").write_text(yaml.safe_dump(ensemble))
    return repo


def run_overhead(seconds: float, log_dir: Path, rounds: int = 3) -> list[Point]:
    """The same tiny model called directly and through a one-step ensemble, alternating."""
    workdir = OUT / "overhead"
    workdir.mkdir(parents=True, exist_ok=True)
    repo = _overhead_repository(workdir)
    port = free_port()
    argv = [
        str(envs.MAIN_VENV / "bin" / "python"), "-m", "rtserve.cli", "serve",
        "--model-repository", str(repo), "--host", "127.0.0.1",
        "--http-port", str(port), "--grpc-port", str(free_port()),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env.update(PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    server = Server("overhead", argv, env, log_dir / "overhead.log", cwd=ROOT)
    points = []
    try:
        server.wait_ready(f"http://127.0.0.1:{port}/v2/models/single/ready", 60.0)
        routes = [("double", "direct", "x"), ("single", "ensemble", "X")]
        for round_no in range(1, rounds + 1):
            for model, name, tensor in routes if round_no % 2 else routes[::-1]:
                point = Point(f"overhead_{name}", f"{name} ({model})", round_no)
                doc = {"inputs": [{"name": tensor, "shape": [1, 4], "datatype": "FP32",
                                   "data": [0.5, 1.0, 1.5, 2.0]}]}  # fmt: skip
                load(f"http://127.0.0.1:{port}/v2/models/{model}/infer",
                     [json.dumps(doc).encode()], seconds, workdir, point, server.pid)  # fmt: skip
                points.append(point)
    finally:
        server.stop()
    return points


# ---------------------------------------------------------------------- report
def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def render(points: list[Point], tokenizer: list[Point], overhead: list[Point],
           args: argparse.Namespace, started: str, elapsed_s: float) -> str:  # fmt: skip
    names = [n for n in CONTENDERS if any(p.name == n for p in points)]
    rows = []
    medians: dict[str, tuple[float, float]] = {}
    cpu: dict[str, float] = {}
    for name in names:
        mine = [p for p in points if p.name == name]
        good = [p for p in mine if not p.error]
        rps = _median([p.rps for p in good])
        p99 = _median([p.p99_ms for p in good])
        medians[name] = (rps, p99)
        cpu[name] = _median([p.cpu_ms_per_request for p in good])
        per_round = " / ".join(
            f"{p.rps:.0f}" if not p.error else "failed" for p in sorted(mine, key=lambda p: p.round)
        )
        cos = next(
            (p.extra.get("cosine_to_rtserve") for p in good if "cosine_to_rtserve" in p.extra), None
        )
        errors = sum(p.errors for p in mine)
        why = "; ".join(sorted({p.error for p in mine if p.error}))
        rows.append(
            f"| {CONTENDERS[name].label} | {rps:.0f} | {per_round} | "
            f"{_median([p.p50_ms for p in good]):.1f} | {p99:.1f} | "
            f"{_median([p.cpu_ms_per_request for p in good]):.2f} | {errors} | "
            f"{'' if cos is None else f'{cos:.4f}'} {why} |"
        )
    peers: list[str] = [
        n for n in ("fastapi", "litserve", "bentoml") if n in medians and medians[n][0] > 0
    ]
    best = max(peers, key=lambda n: medians[n][0]) if peers else None
    lines = [
        "# Pipeline benchmark: text-embedding end to end",
        "",
        f"Run {started} UTC, {elapsed_s / 60:.1f} min, on {machine.summary()}, "
        f"{machine.memory_gib():.0f} GiB; load average at start "
        f"{' / '.join(f'{v:.2f}' for v in args.load_at_start)}"
        + (
            ". **Other work shared these 2 cores during the run**"
            if args.load_at_start[0] > 1.5
            else " (a quiet machine)"
        )
        + ": treat differences under ~15% as noise.",
        "",
        "```sh",
        f"make examples && .venv/bin/python -m bench.pipelines --seconds {args.seconds:g} "
        f"--rounds {args.rounds} --threads {INTRA_OP_THREADS}",
        "```",
        "",
        "Sentences in (examples/data/sentences.txt, rotated per request, one per request), a "
        "normalised 384-d embedding out. Every server runs the same pipeline: the "
        "all-MiniLM-L6-v2 tokenizer (`tokenizers`, the same tokenizer.json) and the same "
        f"INT8 ONNX file (`examples/repository/minilm-int8`), with {INTRA_OP_THREADS} ONNX "
        "Runtime intra-op threads in all (rtserve's two MiniLM instances get "
        f"{max(1, INTRA_OP_THREADS // 2)} each). The peers batch as their docs show (LitServe "
        f"and BentoML: max {MAX_BATCH}, {MAX_WAIT_MS:g} ms wait for LitServe; the naive FastAPI "
        "app runs one request at a time per thread of its sync-endpoint pool). "
        f"Load: `wrk -t1 -c{CONNECTIONS} -d{args.seconds:g}s` after a 3 s warm-up, client on "
        "the same machine; one server at a time; rounds alternate the order.",
        "",
        "| server | req/s (median) | req/s per round | p50 ms | p99 ms | server CPU ms/request | "
        "errors | cosine to rtserve's answer |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |",
        *rows,
        "",
    ]
    if best is not None:
        b_rps, b_p99 = medians[best]
        b_cpu = cpu[best]
        lines += [f"Against the best peer by req/s ({CONTENDERS[best].label}):", ""]
        for name in (n for n in medians if n.startswith("rtserve") and medians[n][0] > 0):
            r_rps, r_p99 = medians[name]
            lines.append(
                f"- {CONTENDERS[name].label}: **{r_rps / b_rps:.2f}x** req/s; p99 {r_p99:.1f} ms "
                f"vs {b_p99:.1f} ms; server CPU per request {cpu[name]:.2f} ms vs {b_cpu:.2f} ms "
                f"({b_cpu / cpu[name]:.2f}x less)."
            )
        lines += [
            "",
            "The model's compute is most of each request, so req/s follows how much of the two "
            "cores a server gets, and on a shared machine that share swings between rounds; "
            "server CPU time per request (the server's process and its children, over the "
            "measured interval) is the steadier measure of how much work each server spends "
            "per answer.",
            "",
        ]
    if tokenizer:
        lines += [
            "## The Python step alone (thread vs process isolation)",
            "",
            "rtserve serving only the `minilm-tokenizer` Python model (V2 JSON, one sentence per "
            f"request, wrk -c{CONNECTIONS}); CPU is the server's and its worker processes'.",
            "",
            "| isolation | req/s | p50 ms | p99 ms | server CPU ms/request |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for p in tokenizer:
            if p.error:
                lines.append(f"| {p.label} | failed: {p.error} | | | |")
            else:
                lines.append(
                    f"| {p.label.split('(')[-1].rstrip(')')} | {p.rps:.0f} | {p.p50_ms:.2f} | "
                    f"{p.p99_ms:.2f} | {p.cpu_ms_per_request:.3f} |"
                )
        by = {p.name: p for p in tokenizer if not p.error}
        if "tokenizer_thread" in by and "tokenizer_process" in by:
            t, p = by["tokenizer_thread"], by["tokenizer_process"]
            lines += [
                "",
                "Process isolation against thread isolation: server CPU per request "
                f"{(p.cpu_ms_per_request - t.cpu_ms_per_request) * 1000:+.0f} µs (the "
                "shared-memory hand-off to the worker and back, against the GIL the thread "
                f"shares with the event loop), req/s {(p.rps - t.rps) / t.rps * 100:+.0f}%.",
            ]
        lines.append("")
    if overhead:
        lines += [
            "## What the ensemble layer costs",
            "",
            "A tiny ONNX model (y = 2x, one row per request, V2 JSON, wrk "
            f"-c{CONNECTIONS}) called directly and through a one-step ensemble, same server.",
            "",
            "| route | req/s (median; rounds) | p50 ms | p99 ms | server CPU ms/request |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        med: dict[str, dict[str, float]] = {}
        for name in ("overhead_direct", "overhead_ensemble"):
            mine = [p for p in overhead if p.name == name and not p.error]
            if not mine:
                continue
            med[name] = {
                k: _median([getattr(p, k) for p in mine])
                for k in ("rps", "p50_ms", "p99_ms", "cpu_ms_per_request")
            }
            rounds = " / ".join(f"{p.rps:.0f}" for p in mine)
            m = med[name]
            lines.append(
                f"| {mine[0].label} | {m['rps']:.0f} ({rounds}) | {m['p50_ms']:.2f} | "
                f"{m['p99_ms']:.2f} | {m['cpu_ms_per_request']:.3f} |"
            )
        if len(med) == 2:
            d, e = med["overhead_direct"], med["overhead_ensemble"]
            lines += [
                "",
                "Medians of alternating rounds (per-round req/s in brackets). The ensemble adds "
                f"{(e['cpu_ms_per_request'] - d['cpu_ms_per_request']) * 1000:+.0f} µs of server "
                "CPU per request (a task, the step lookup, the step's own metrics).",
            ]
        lines.append("")
    lines += [
        f"Raw points: `bench/.work/pipelines/results-{args.out.stem}.json`, servers' logs in "
        "`bench/.work/pipelines/logs/` (not committed).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    global INTRA_OP_THREADS
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--no-tokenizer", action="store_true", help="skip the Python-step points")
    parser.add_argument("--no-overhead", action="store_true", help="skip the ensemble-cost points")
    parser.add_argument(
        "--threads",
        type=int,
        default=INTRA_OP_THREADS,
        help="ONNX Runtime intra-op threads for every server's model",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks-pipelines.md")
    args = parser.parse_args()
    INTRA_OP_THREADS = args.threads
    if not (EXAMPLES / "text-embedding" / "config.yaml").exists():
        raise SystemExit("examples/repository has no text-embedding: run `make examples` first")
    args.load_at_start = machine.load_average()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    t0 = time.monotonic()
    OUT.mkdir(parents=True, exist_ok=True)
    log_dir = OUT / "logs"
    texts = sentences()
    names = [n for n in args.contenders.split(",") if n]
    points: list[Point] = []
    reference: np.ndarray | None = None
    if "rtserve" in names:  # every server's answer is compared with rtserve's
        server, port = start("rtserve", OUT / "reference", log_dir)
        try:
            reference = embedding_of("rtserve", port, texts[0])
        finally:
            server.stop()
    for round_no in range(1, args.rounds + 1):
        shift = (round_no - 1) % len(names)
        order = names[shift:] + names[:shift]
        if round_no % 2 == 0:
            order = order[::-1]
        for name in order:
            point = run_contender(name, round_no, args.seconds, log_dir, reference, texts)
            print(f"round {round_no} {name}: {point.rps:.0f} req/s p99 {point.p99_ms:.1f} ms "
                  f"{point.error}", flush=True)  # fmt: skip
            points.append(point)
    tokenizer: list[Point] = []
    if not args.no_tokenizer:
        for isolation in ("thread", "process"):
            point = run_tokenizer_alone(isolation, args.seconds, log_dir, texts)
            print(f"tokenizer {isolation}: {point.rps:.0f} req/s "
                  f"{point.cpu_ms_per_request:.3f} ms CPU/request", flush=True)  # fmt: skip
            tokenizer.append(point)
    overhead: list[Point] = []
    if not args.no_overhead:
        overhead = run_overhead(args.seconds, log_dir)
        for point in overhead:
            print(f"{point.name}: {point.rps:.0f} req/s "
                  f"{point.cpu_ms_per_request:.3f} ms CPU/request", flush=True)  # fmt: skip
    (OUT / f"results-{args.out.stem}.json").write_text(
        json.dumps([p.__dict__ for p in points + tokenizer + overhead], indent=2, default=str)
    )
    args.out.write_text(render(points, tokenizer, overhead, args, started, time.monotonic() - t0))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
