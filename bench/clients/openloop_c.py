"""The C open-loop client (``openloop.c``): built on first use with the system's C compiler.

Same measurement as ``bench.clients.openloop`` (Poisson arrivals, latency from each
scheduled send, a pool of keep-alive connections opened first), at a fraction of its CPU
per request, which matters where the client shares the server's cores.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("openloop.c")
BUILD = Path(__file__).resolve().parent.parent / ".work" / "openloop"


def build() -> Path:
    """The client's binary, compiled again when the source is newer."""
    if BUILD.exists() and BUILD.stat().st_mtime >= SOURCE.stat().st_mtime:
        return BUILD
    BUILD.parent.mkdir(parents=True, exist_ok=True)
    tmp = BUILD.with_suffix(f".{os.getpid()}")
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O2", "-o", str(tmp), str(SOURCE), "-lm"], check=True)
    tmp.replace(BUILD)  # atomic: concurrent builders never run a half-written binary
    return BUILD


def command(
    host: str, port: int, request: Path, rate: float, seconds: float, seed: int, conns: int,
    drain_s: float, result: Path,
) -> list[str]:  # fmt: skip
    """The command line that offers ``rate`` requests/s of the raw HTTP ``request`` and
    writes its JSON result (``elapsed``, ``lag_p99_ms``, ``scheduled``, ``unfinished``,
    ``errors``, ``codes``, ``latency_ms``) to ``result``."""
    return [
        str(build()), host, str(port), str(request), repr(float(rate)), repr(float(seconds)),
        str(seed), str(conns), repr(float(drain_s)), str(result),
    ]  # fmt: skip
