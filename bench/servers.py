"""How each peer is installed, configured, started and asked whether it is ready."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import envs
from bench.peers.common import PeerSettings
from bench.procs import Server, free_port
from bench.workloads import ROOT, WORK, Workload

MAX_BATCH = 32
MAX_WAIT_MS = 1.0
INTER_OP_THREADS = 1


@dataclass(frozen=True)
class Peer:
    """A server under test: its recipe. ``env`` names its virtual environment (``main``: the
    project's); ``module`` is what ``python -m`` runs (its settings travel in ``BENCH_PEER``);
    ``v2``: it speaks the Open Inference Protocol (perf_analyzer can measure it); ``kind``:
    ``peer``, or ``limit``/``reference`` for the yardsticks; ``env_vars``: extra environment."""

    name: str
    label: str
    env: str
    health: str
    infer: str
    v2: bool = False
    grpc: bool = False
    kind: str = "peer"
    start_timeout_s: float = 60.0
    distribution: str | None = None
    src: str | None = None  # rtserve only: the source tree to run (default: this checkout's)
    module: str = ""
    env_vars: tuple[tuple[str, str], ...] = ()

    @property
    def is_rtserve(self) -> bool:
        return self.name == "rtserve" or self.src is not None

    def infer_path(self, model: str) -> str:
        return self.infer.format(model=model)

    def health_path(self, model: str) -> str:
        return self.health.format(model=model)


V2_READY, V2_INFER = "/v2/models/{model}/ready", "/v2/models/{model}/infer"
PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer("rtserve", "rtserve", "main", V2_READY, V2_INFER, v2=True, grpc=True, distribution="rtserve"),
        Peer("bare_asgi", "bare ASGI (no model, limit)", "main", "/", V2_INFER, kind="limit",
             distribution="uvicorn", module="bench.peers.bare_asgi"),
        Peer("raw_asgi", "raw ASGI, 1 run/request", "main", "/", V2_INFER, kind="reference",
             distribution="uvicorn", module="bench.peers.raw_asgi"),
        Peer("fastapi", "naive FastAPI", "fastapi", "/health", "/infer", distribution="fastapi",
             module="bench.peers.naive_fastapi"),
        Peer("mlserver", "MLServer", "mlserver", V2_READY, V2_INFER, v2=True, grpc=True,
             distribution="mlserver"),
        Peer("litserve", "LitServe", "litserve", "/health", "/infer", distribution="litserve",
             module="bench.peers.litserve_app"),
        Peer("bentoml", "BentoML", "bentoml", "/readyz", "/infer", distribution="bentoml",
             env_vars=(("BENTOML_DO_NOT_TRACK", "True"),)),
        Peer("rayserve", "Ray Serve", "rayserve", "/infer", "/infer", start_timeout_s=120.0,
             distribution="ray", module="bench.peers.rayserve_app",
             env_vars=(("RAY_worker_niceness", "0"), ("RAY_USAGE_STATS_ENABLED", "0"))),
        Peer("pytriton", "Triton (PyTriton)", "pytriton", V2_READY, V2_INFER, v2=True, grpc=True,
             start_timeout_s=120.0, distribution="nvidia-pytriton", module="bench.peers.pytriton_app"),
        Peer("mosec", "mosec", "mosec", "/", "/inference", distribution="mosec", module="bench.peers.mosec_app"),
    )
}  # fmt: skip


def baseline_peer(ref: str, src: Path) -> Peer:
    """rtserve as of another commit: the same recipe, run from that commit's ``src``."""
    return replace(PEERS["rtserve"], name="rtserve_baseline", label=f"rtserve @ {ref}",
                   src=str(src), distribution=None)  # fmt: skip


def peer_settings(
    workload: Workload, workdir: Path, max_wait_ms: float = MAX_WAIT_MS
) -> PeerSettings:
    """The settings every peer reads (from ``BENCH_PEER``), on ports the OS has free."""
    return PeerSettings(
        model_name=workload.model_name,
        model_path=str(workload.model_path()),
        inputs=workload.inputs,
        outputs=workload.outputs,
        intra_op_threads=workload.intra_op_threads,
        inter_op_threads=INTER_OP_THREADS,
        max_batch_size=MAX_BATCH,
        max_wait_ms=max_wait_ms,
        workdir=str(workdir),
        port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )


@dataclass
class Running:
    peer: Peer
    server: Server
    settings: PeerSettings

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def url(self, model: str) -> str:
        return self.base_url + self.peer.infer_path(model)


def _rtserve_repository(
    cfg: PeerSettings, workdir: Path, extra: Mapping[str, Any] | None = None
) -> Path:
    """rtserve's model repository for ``cfg``; ``extra`` adds config sections (a cache)."""
    repo = workdir / "repository"
    version = repo / cfg.model_name / "1"
    version.mkdir(parents=True, exist_ok=True)
    target = version / "model.onnx"
    if not target.exists():
        shutil.copyfile(cfg.model_path, target)
    config = {
        "max_batch_size": cfg.max_batch_size,
        "dynamic_batching": {"max_queue_delay_us": round(cfg.max_wait_ms * 1000),
                             "preferred_batch_sizes": [cfg.max_batch_size], "max_queue_size": 1024},
        "instance_count": 1,
        "onnxruntime": {"intra_op_threads": cfg.intra_op_threads,
                        "inter_op_threads": cfg.inter_op_threads, "graph_optimization_level": "all"},
        "warmup": {"batch_sizes": [1, cfg.max_batch_size], "iterations": 3},
        **(extra or {}),
    }  # fmt: skip
    # JSON is valid YAML: no YAML writer needed here.
    (repo / cfg.model_name / "config.yaml").write_text(json.dumps(config, indent=2) + "\n")
    return repo


def _mlserver_folder(cfg: PeerSettings, workdir: Path) -> Path:
    folder = workdir / "mlserver"
    model_dir = folder / cfg.model_name
    model_dir.mkdir(parents=True, exist_ok=True)
    (folder / "settings.json").write_text(
        json.dumps(
            {
                "host": cfg.host,
                "http_port": cfg.port,
                "grpc_port": cfg.grpc_port,
                "metrics_port": cfg.metrics_port,
                "metrics_endpoint": None,
                "parallel_workers": 0,
                "debug": False,
                "gzip_enabled": False,
                "load_models_at_startup": True,
            }
        )
    )
    (model_dir / "model-settings.json").write_text(
        json.dumps(
            {
                "name": cfg.model_name,
                "implementation": "bench.peers.mlserver_runtime.OnnxModel",
                "max_batch_size": cfg.max_batch_size,
                "max_batch_time": cfg.max_wait_ms / 1000,
                "parameters": {"uri": cfg.model_path},
            }
        )
    )
    return folder


def command(
    peer: Peer, cfg: PeerSettings, workdir: Path, model_config: Mapping[str, Any] | None = None
) -> list[str]:
    """The argv that starts ``peer`` (its settings travel in the environment).

    ``model_config`` adds sections to rtserve's model config (other peers ignore it).
    """
    env = envs.main_env() if peer.env == "main" else envs.peer_env(peer.env)
    python = str(env.python)
    if peer.is_rtserve:
        repo = _rtserve_repository(cfg, workdir, model_config)
        return [
            python, "-m", "rtserve.cli", "serve", "--model-repository", str(repo),
            "--host", cfg.host, "--http-port", str(cfg.port), "--grpc-port", str(cfg.grpc_port),
        ]  # fmt: skip
    if peer.name == "mlserver":
        return [str(env.bin / "mlserver"), "start", str(_mlserver_folder(cfg, workdir))]
    if peer.name == "bentoml":
        return [
            str(env.bin / "bentoml"), "serve", "bench.peers.bentoml_service:Onnx",
            "--host", cfg.host, "--port", str(cfg.port), "--working-dir", str(ROOT),
        ]  # fmt: skip
    return [python, "-m", peer.module]


def environment(peer: Peer, cfg: PeerSettings, workdir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k in ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "USER", "TMPDIR")
    }
    venv = envs.MAIN_VENV if peer.env == "main" else envs.peer_env(peer.env).path
    paths = [str(ROOT)] + ([peer.src or str(ROOT / "src")] if peer.is_rtserve else [])
    env.update(
        BENCH_PEER=cfg.to_json(),
        PYTHONPATH=os.pathsep.join(paths),
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        OMP_NUM_THREADS=str(cfg.intra_op_threads),
        PYTHONUNBUFFERED="1",
    )
    env.update(peer.env_vars)
    if peer.name == "bentoml":
        env["BENTOML_HOME"] = str(workdir / "bentoml_home")
    if peer.name == "pytriton":
        env["LD_LIBRARY_PATH"] = str(venv / "lib")
        # PyTriton loads the interpreter's libpython from <prefix>/lib.
        base_lib = Path(os.path.realpath(envs.peer_env(peer.env).python)).parent.parent / "lib"
        env["LD_LIBRARY_PATH"] = f"{base_lib}{os.pathsep}{env['LD_LIBRARY_PATH']}"
    return env


def start(
    peer: Peer,
    workload: Workload,
    run_dir: Path,
    model_config: Mapping[str, Any] | None = None,
    max_wait_ms: float | None = None,
) -> Running:
    """Install (once), configure and start ``peer``; return when it answers its health route.

    Its log is ``run_dir/logs/<workload>-<peer>.log``; ``model_config`` adds sections to
    rtserve's model config (e.g. ``response_cache``); ``max_wait_ms`` replaces the suite's
    batching window.
    """
    if peer.env != "main":
        envs.ensure(peer.env)
    tag = "" if max_wait_ms is None else f"-w{max_wait_ms:g}"
    workdir = WORK / "peers" / f"{peer.name}-{workload.name}{tag}"
    if workdir.exists():
        shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    cfg = peer_settings(workload, workdir, MAX_WAIT_MS if max_wait_ms is None else max_wait_ms)
    if peer.name == "rayserve":
        cfg = replace(cfg, workdir=f"/tmp/rtb-ray-{os.getpid()}")
    server = Server(
        peer.name,
        command(peer, cfg, workdir, model_config),
        environment(peer, cfg, workdir),
        run_dir / "logs" / f"{workload.name}-{peer.name}{tag}.log",
        cwd=ROOT,
    )
    running = Running(peer, server, cfg)
    try:
        server.wait_ready(
            running.base_url + peer.health_path(workload.model_name), peer.start_timeout_s
        )
    except RuntimeError:
        server.stop()
        raise
    return running


def stop(running: Running) -> list[int]:
    killed = running.server.stop()
    if running.peer.name == "rayserve":
        shutil.rmtree(running.settings.workdir, ignore_errors=True)
    return killed
