"""Facts about the machine and the software a run measured."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return float("nan")


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def tool_version(argv: list[str], env: dict[str, str] | None = None) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=20, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return text[0].strip() if text else "?"


def facts() -> dict[str, str]:
    return {
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "memory": f"{memory_gib():.1f} GiB",
        "kernel": platform.release(),
        "os": platform.platform(terse=True),
        "python": sys.version.split()[0],
        "load average at start": " / ".join(f"{v:.2f}" for v in load_average()),
    }


def summary() -> str:
    """One line for a report header: CPU model, core count, Python version."""
    return f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def source_state() -> str:
    """The commit the code ran from, and whether files under src/ differed from it."""
    git = ["git", "-C", str(Path(__file__).resolve().parent.parent)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, timeout=10).stdout.splitlines()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (
        f"commit {head}"
        + (f" + uncommitted changes in {len(dirty)} files under src/" if dirty else "")
        if head
        else "?"
    )
