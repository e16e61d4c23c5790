"""wrk: closed-loop HTTP load with a fixed POST body, results read from a Lua ``done`` hook."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from bench.results import Measurement

_MARKER = "BENCH_JSON "

# Prints the run's figures as one JSON line, with the per-thread values of a script's global
# ``counts`` table (if any) summed over the threads.
DONE_HOOK = """
local threads = {}
function setup(thread) table.insert(threads, thread) end

done = function(summary, latency, requests)
  local e, sum, extra = summary.errors, {}, ""
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("counts") or {}) do sum[k] = (sum[k] or 0) + v end
  end
  for k, v in pairs(sum) do extra = extra .. string.format(',"%s":%d', k, v) end
  io.write(string.format('BENCH_JSON {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,'
    .. '"write":%d,"status":%d,"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d%s}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), extra))
end
"""


def _long_string(text: str) -> str:
    """``text`` as a Lua long string whose brackets nothing in ``text`` closes."""
    eq = "="
    while f"]{eq}]" in text:
        eq += "="
    return f"[{eq}[{text}]{eq}]"


def lua_script(body: bytes, rotate: Sequence[bytes] = ()) -> str:
    """A wrk script that POSTs ``body`` (or each of ``rotate`` in turn, for one wrk thread)
    and prints exact percentiles as one JSON line."""
    script = (
        f'wrk.method = "POST"\nwrk.body = {_long_string(body.decode())}\n'
        'wrk.headers["Content-Type"] = "application/json"\n' + DONE_HOOK
    )
    if rotate:
        items = ",\n".join(_long_string(b.decode()) for b in rotate)
        script += (
            f"bodies = {{\n{items}\n}}\nlocal i = 0\nrequest = function()\n"
            '  i = i % #bodies + 1\n  return wrk.format("POST", nil, nil, bodies[i])\nend\n'
        )
    return script


def _done_line(output: str) -> dict[str, int]:
    """The ``done`` hook's JSON line; ValueError when wrk printed none (it failed)."""
    for line in output.splitlines():
        if line.startswith(_MARKER):
            return dict(json.loads(line[len(_MARKER) :]))
    raise ValueError(f"no result line in wrk's output: {output.strip()[-160:]!r}")


def parse(output: str) -> dict[str, float]:
    """Throughput, percentiles (ms) and error count from the ``done`` hook's JSON line."""
    data = _done_line(output)
    seconds = data["duration_us"] / 1e6
    return {
        "requests": data["requests"],
        "rps": data["requests"] / seconds if seconds else 0.0,
        "p50_ms": data["p50_us"] / 1000,
        "p90_ms": data["p90_us"] / 1000,
        "p99_ms": data["p99_us"] / 1000,
        "errors": sum(data[k] for k in ("connect", "read", "write", "status", "timeout")),
    }


def done_counts(output: str) -> dict[str, int]:
    """The script's ``counts`` as the ``done`` hook summed them (beyond the standard fields)."""
    try:
        data = _done_line(output)
    except ValueError:
        return {}
    return {k: int(v) for k, v in data.items() if k not in _STANDARD}


_STANDARD = {"requests", "duration_us", "connect", "read", "write", "status", "timeout",
             "p50_us", "p90_us", "p99_us"}  # fmt: skip


def measure(
    url: str,
    script: Path,
    connections: int,
    duration_s: float,
    base: Measurement,
    script_args: Sequence[str] = (),
) -> Measurement:
    """Run wrk once (one thread); a failure becomes a Measurement with ``error`` set.

    ``script_args`` go to the Lua script's ``init``; the ``counts`` its ``done`` hook
    prints land in ``base.extra["counts"]``.
    """
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration_s))}s", "--timeout",
           "10s", "--latency", "-s", str(script), url]  # fmt: skip
    if script_args:
        cmd += ["--", *script_args]
    base.extra["command"] = " ".join(cmd)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 30)
        parsed = parse(proc.stdout)
        counts = done_counts(proc.stdout)
    except (subprocess.TimeoutExpired, ValueError, OSError) as exc:
        base.error = f"wrk: {exc}"
        return base
    base.rps = parsed["rps"]
    base.requests = int(parsed["requests"])
    base.errors = int(parsed["errors"])
    base.p50_ms, base.p90_ms, base.p99_ms = parsed["p50_ms"], parsed["p90_ms"], parsed["p99_ms"]
    if counts:
        base.extra["counts"] = counts
    if base.requests and base.errors >= base.requests:
        base.error = "every request failed"
    return base
