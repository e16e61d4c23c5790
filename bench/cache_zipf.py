"""Response-cache benchmark: a Zipf stream with repeats against rtserve, four cache setups.

The stream models search/recommendation traffic: a request is either one of ``hot``
distinct MLP inputs drawn with Zipf(``exponent``) popularity, or a one-off input never
seen before; the mix is chosen so that the stream's repeat rate (the share of requests
whose input appeared earlier: the best hit rate any cache could reach) is ``repeat``.

rtserve is started four times on the same model and stream: no cache, L1 only (memory),
L2 only (Redis) and L1+L2. wrk drives 32 keep-alive connections from one thread; a Lua
script walks the stream, builds the one-off bodies on the fly and counts the
``x-rtserve-cache`` response header, so the hit rate is what the server reported.

    python -m bench.cache_zipf --quick        # ~1 minute
    python -m bench.cache_zipf                # longer runs, three rounds (~4 minutes)

Results go to docs/benchmarks-cache.md (and bench/.work/cache/results.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import redis
import yaml

from bench import servers
from bench.clients import wrk
from bench.procs import Server, free_port
from bench.workloads import MLP, ROOT, WORK

WORKDIR = WORK / "cache"
DOC = ROOT / "docs" / "benchmarks-cache.md"
MODEL = MLP.model_name
CACHE_HEADER = "x-rtserve-cache"

_LUA = r"""
-- args: host:port, file of hot bodies (one per line), stream file (one int per line:
-- 0 = a one-off input, k = hot input k), one-off body prefix file, suffix file, and the
-- first one-off number (distinct per run, so no run sees another run's one-offs).
local reqs, stream, pos, fresh = {}, {}, 0, 0
local headers = {}
local prefix, suffix
local counts = {memory = 0, redis = 0, miss = 0, bypass = 0, none = 0}
local threads = {}

local function slurp(path)
  local f = assert(io.open(path, "rb")); local s = f:read("*a"); f:close(); return s
end

function setup(thread) table.insert(threads, thread) end

function init(args)
  headers = {["Host"] = args[1], ["Content-Type"] = "application/json"}
  for line in io.lines(args[2]) do
    reqs[#reqs + 1] = wrk.format("POST", "/v2/models/__MODEL__/infer", headers, line)
  end
  for line in io.lines(args[3]) do stream[#stream + 1] = tonumber(line) end
  prefix, suffix = slurp(args[4]), slurp(args[5])
  fresh = tonumber(args[6])
end

function request()
  pos = pos % #stream + 1
  local k = stream[pos]
  if k > 0 then return reqs[k] end
  fresh = fresh + 1
  return wrk.format("POST", "/v2/models/__MODEL__/infer", headers, prefix .. fresh .. suffix)
end

function response(status, hdrs, body)
  local c = hdrs["__HEADER__"]
  if c == nil then c = "none" else c = c:gsub("^hit%-", "") end
  if counts[c] == nil then c = "none" end
  counts[c] = counts[c] + 1
  memory, redis_, miss, bypass, none =
    counts.memory, counts.redis, counts.miss, counts.bypass, counts.none
end

done = function(summary, latency, requests)
  local sum = {memory = 0, redis_ = 0, miss = 0, bypass = 0, none = 0}
  for _, t in ipairs(threads) do
    for k, _ in pairs(sum) do sum[k] = sum[k] + (t:get(k) or 0) end
  end
  local e = summary.errors
  io.write(string.format('BENCH_JSON {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,'
    .. '"write":%d,"status":%d,"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,'
    .. '"memory":%d,"redis":%d,"miss":%d,"bypass":%d,"none":%d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    sum.memory, sum.redis_, sum.miss, sum.bypass, sum.none))
end
"""


NOTES = """\
How to read it:
- The MLP is the transport-bound workload: its share of a batch is a few µs per row, so a
  hit saves little compute. What a hit saves is the batcher's gather wait and the model run;
  it still pays HTTP parsing and encoding, the key (BLAKE2b over the 1 KB input) and the L1
  lookup. A miss pays the key and the L1 insert on top of the normal path.
- L2 costs a Redis round trip on every L1 miss. redis-py spends ~45 µs of CPU per command,
  so rtserve sends the reads of one event-loop iteration as one MGET and pipelines the
  writes from a background task; on a 2-core machine redis-server also competes with the
  server and wrk for the cores.
- With one server, L1 + L2 answers repeats from L1; L2 earns its keep across replicas and
  restarts: the *restarted* row starts with an empty L1 and a warm Redis.
- A cache pays off in throughput when the model's cost per request exceeds these costs
  (e.g. MiniLM, milliseconds per batch); whether it does for the MLP is what the table shows.
- "server CPU µs/req" is rtserve's own CPU time per answered request; it is less disturbed
  by other load on a shared machine than req/s.
"""


@dataclass(frozen=True)
class Setup:
    name: str
    memory: bool
    redis: bool
    warm_redis: bool = False  # keep what the previous setup left in Redis (a restart)


SETUPS = (
    Setup("no cache", False, False),
    Setup("L1 only (memory)", True, False),
    Setup("L2 only (Redis)", False, True),
    Setup("L1 + L2", True, True),
    Setup("L1 + L2, restarted", True, True, warm_redis=True),
)


@dataclass
class Result:
    setup: str
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    tiers: dict[str, int] = field(default_factory=dict)
    redis_errors: float = 0.0
    server_cpu_us: float = 0.0  # rtserve's CPU time (all threads) per answered request

    @property
    def hit_rate(self) -> float:
        answered = sum(self.tiers.values())
        hits = self.tiers.get("memory", 0) + self.tiers.get("redis", 0)
        return hits / answered if answered else 0.0


# ----------------------------------------------------------------------------- the stream
def zipf_stream(
    length: int, hot: int, exponent: float, share: float, rng: np.random.Generator
) -> np.ndarray:
    """Stream of hot-input numbers (1..hot, Zipf popularity) and 0 for one-off inputs."""
    weights = 1.0 / np.arange(1, hot + 1, dtype=np.float64) ** exponent
    picks = rng.choice(hot, size=length, p=weights / weights.sum()) + 1
    return np.where(rng.random(length) < share, picks, 0)


def repeat_rate(stream: np.ndarray) -> float:
    """Share of requests whose input appeared earlier in the stream (one-offs never do)."""
    hot = stream[stream > 0]
    return (len(hot) - len(np.unique(hot))) / len(stream)


def stream_for(
    length: int, hot: int, exponent: float, target: float, seed: int
) -> tuple[np.ndarray, float]:
    """Bisect the hot share until the stream's repeat rate is ``target`` (to 0.5%)."""
    lo, hi = 0.0, 1.0
    for _ in range(30):
        share = (lo + hi) / 2
        stream = zipf_stream(length, hot, exponent, share, np.random.default_rng(seed))
        rate = repeat_rate(stream)
        if abs(rate - target) < 0.005:
            break
        lo, hi = (share, hi) if rate < target else (lo, share)
    return stream, rate


def _row(values: np.ndarray) -> list[float]:
    return [round(float(v), 4) for v in values]


def write_inputs(folder: Path, stream: np.ndarray, hot: int, seed: int) -> list[str]:
    """Files the Lua script reads; returns its arguments after host:port."""
    rng = np.random.default_rng(seed + 1)
    rows = rng.uniform(-1.0, 1.0, size=(hot + 1, 256)).astype(np.float32)
    lines = [
        orjson.dumps(
            {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": _row(r)}]}
        ).decode()
        for r in rows[:hot]
    ]
    paths = {name: folder / name for name in ("hot.txt", "stream.txt", "prefix.txt", "suffix.txt")}
    paths["hot.txt"].write_text("\n".join(lines) + "\n")
    paths["stream.txt"].write_text("\n".join(str(int(k)) for k in stream) + "\n")
    # One-off bodies: the spare row with its first value replaced by a counter (large, so it
    # never equals a hot row, whose values lie in [-1, 1]).
    rest = ",".join(f"{v:.4f}" for v in _row(rows[hot][1:]))
    paths["prefix.txt"].write_text(
        '{"inputs":[{"name":"input","shape":[1,256],"datatype":"FP32","data":['
    )
    paths["suffix.txt"].write_text(f",{rest}]}}]}}")
    return [str(paths[n]) for n in ("hot.txt", "stream.txt", "prefix.txt", "suffix.txt")]


# ----------------------------------------------------------------------------- processes
class RedisProcess:
    """redis-server on a free 127.0.0.1 port without persistence, stopped by PID."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(folder)]
        self.server = Server("redis", argv, dict(os.environ), folder / "redis.log", cwd=folder)
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis.RedisError as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    tail = self.server.log_tail()
                    raise RuntimeError(f"redis-server did not start: {tail}") from exc
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def flush(self) -> None:
        self.client.flushall()

    def stop(self) -> None:
        self.client.close()
        self.server.stop(grace_s=5)


def write_repository(
    folder: Path, setup: Setup, redis_url: str, l1_bytes: int = 256 * 1024 * 1024
) -> Path:
    """The main benchmark's rtserve repository for the MLP, plus this setup's cache section."""
    cfg = servers.peer_settings(MLP, folder)
    repo = servers._rtserve_repository(cfg, folder)
    config_path = repo / MODEL / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    cache: dict[str, Any] = {}
    if setup.memory:
        cache["memory"] = {"max_bytes": l1_bytes, "ttl_s": 600}
    if setup.redis:
        cache["redis"] = {"url": redis_url, "ttl_s": 600, "namespace": "bench"}
    if cache:
        config["response_cache"] = cache
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return repo


def start_rtserve(repo: Path, log: Path) -> tuple[Server, str]:
    http_port, grpc_port = free_port(), free_port()
    rtserve = ROOT / ".venv" / "bin" / "rtserve"
    argv = [str(rtserve) if rtserve.exists() else "rtserve", "serve"]
    argv += ["--model-repository", str(repo), "--host", "127.0.0.1"]
    argv += ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    server = Server("rtserve", argv, env, log, cwd=ROOT)
    base = f"http://127.0.0.1:{http_port}"
    try:
        server.wait_ready(base + "/v2/health/ready", timeout_s=90)
    except RuntimeError:
        server.stop()
        raise
    return server, base


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(base: str, metric: str) -> float:
    """Sum of every sample of ``metric`` on /metrics (0 when absent)."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    pattern = re.compile(rf"^{re.escape(metric)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


# ----------------------------------------------------------------------------- one run
# One-off inputs of run n are numbered from (n + 1) * ONE_OFFS_PER_RUN: exact in FP32 (< 2**24)
# for 80 runs of up to 200k one-offs each.
ONE_OFFS_PER_RUN = 200_000


def measure(
    setup: Setup,
    args: argparse.Namespace,
    redis_proc: RedisProcess,
    lua_args: list[str],
    run_no: int,
) -> Result:
    folder = WORKDIR / "runs" / re.sub(r"[^a-z0-9]+", "-", setup.name.lower()).strip("-")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if not setup.warm_redis:
        redis_proc.flush()
    repo = write_repository(folder, setup, redis_proc.url, args.l1_bytes)
    server, base = start_rtserve(repo, folder / "rtserve.log")
    try:
        host = base.removeprefix("http://")
        script = WORKDIR / "zipf.lua"
        cmd = ["wrk", "-t1", f"-c{args.connections}", f"-d{args.duration}s", "--timeout", "10s"]
        cmd += ["-s", str(script), f"{base}/v2/models/{MODEL}/infer", "--", host, *lua_args]
        cmd.append(str((run_no + 1) * ONE_OFFS_PER_RUN))
        cpu_before = cpu_seconds(server.pid)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration + 60)
        cpu = cpu_seconds(server.pid) - cpu_before
        line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH_JSON ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result: {proc.stdout[-500:]} {proc.stderr[-500:]}")
        parsed = wrk.parse(proc.stdout)
        raw = json.loads(line.removeprefix("BENCH_JSON "))
        redis_errors = scrape(base, "rtserve_cache_redis_errors_total") if setup.redis else 0.0
    finally:
        server.stop()
    return Result(
        setup=setup.name,
        rps=parsed["rps"],
        p50_ms=parsed["p50_ms"],
        p99_ms=parsed["p99_ms"],
        requests=int(parsed["requests"]),
        errors=int(parsed["errors"]),
        tiers={k: int(raw[k]) for k in ("memory", "redis", "miss", "bypass", "none")},
        redis_errors=redis_errors,
        server_cpu_us=cpu / max(1, int(parsed["requests"])) * 1e6,
    )


def _median(results: list[Result]) -> Result:
    """The round with the median throughput (its latencies and hit counts come with it)."""
    ordered = sorted(results, key=lambda r: r.rps)
    return ordered[(len(ordered) - 1) // 2]


# ----------------------------------------------------------------------------- report
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def report(results: list[Result], args: argparse.Namespace, rate: float, stream: np.ndarray) -> str:
    base = results[0]
    one_offs = int((stream == 0).sum())
    distinct = len(np.unique(stream[stream > 0])) + one_offs
    lines = [
        "## Response cache (Zipf stream with repeats)",
        "",
        f"Command: `{' '.join(['python -m bench.cache_zipf', *args.argv])}`",
        f"Machine: {machine()}; load client wrk -t1 -c{args.connections} on the same machine.",
        "",
        f"Stream: {len(stream)} requests (replayed in a loop for {args.duration} s per setup) "
        f"over {args.hot} hot MLP inputs (256 FP32) with Zipf exponent {args.exponent}, "
        f"mixed with one-off inputs; {distinct} distinct inputs in one pass, repeat rate "
        f"**{rate:.1%}** (the best any cache can reach). Each setup starts a fresh rtserve "
        "(and an emptied Redis), so every run includes its cache's warm-up; except "
        "*L1 + L2, restarted*: a new rtserve process right after *L1 + L2*, with Redis as that "
        "run left it (a restart or a new replica). "
        "Hit rate is counted from the `x-rtserve-cache` response header.",
        "",
        "| setup | req/s | vs no cache | p50 ms | p99 ms | server CPU µs/req | hit rate "
        "| L1 hits | L2 hits | errors | Redis errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = r.rps / base.rps if base.rps else float("nan")
        lines.append(
            f"| {r.setup} | {r.rps:,.0f} | {ratio:.2f}x | {r.p50_ms:.2f} | {r.p99_ms:.2f} "
            f"| {r.server_cpu_us:.0f} | {r.hit_rate:.1%} | {r.tiers.get('memory', 0):,} | {r.tiers.get('redis', 0):,} "
            f"| {r.errors} | {r.redis_errors:.0f} |"
        )
    if args.rounds > 1:
        lines += ["", f"Median of {args.rounds} rounds (setups alternate within each round)."]
    return "\n".join(lines) + "\n\n" + NOTES


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.cache_zipf", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short runs, one round")
    parser.add_argument("--repeat", type=float, default=0.5, help="target repeat rate (0-1)")
    parser.add_argument("--hot", type=int, default=2000, help="distinct repeating inputs")
    parser.add_argument("--exponent", type=float, default=1.0, help="Zipf exponent")
    parser.add_argument("--length", type=int, default=None, help="stream length")
    parser.add_argument("--duration", type=int, default=None, help="seconds per setup")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--l1-bytes", type=int, default=256 * 1024 * 1024, help="L1 max_bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DOC)
    args = parser.parse_args(argv)
    args.argv = argv
    args.length = args.length or (100_000 if args.quick else 300_000)
    args.duration = args.duration or (5 if args.quick else 10)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if shutil.which("wrk") is None:
        print("wrk is not installed (make system-deps installs it)", file=sys.stderr)
        return 2

    WORKDIR.mkdir(parents=True, exist_ok=True)
    stream, rate = stream_for(args.length, args.hot, args.exponent, args.repeat, args.seed)
    lua_args = write_inputs(WORKDIR, stream, args.hot, args.seed)
    lua = _LUA.replace("__MODEL__", MODEL).replace("__HEADER__", CACHE_HEADER)
    (WORKDIR / "zipf.lua").write_text(lua)
    MLP.model_path()  # build the model once, outside the timed runs
    print(f"stream: {len(stream)} requests, repeat rate {rate:.1%}", flush=True)

    redis_proc = RedisProcess(WORKDIR)
    runs: dict[str, list[Result]] = {s.name: [] for s in SETUPS}
    done: list[Result] = []
    try:
        for round_no in range(args.rounds):
            for setup in SETUPS:
                result = measure(setup, args, redis_proc, lua_args, len(done))
                done.append(result)
                runs[setup.name].append(result)
                print(
                    f"round {round_no + 1} {setup.name:>18}: {result.rps:8,.0f} req/s  "
                    f"p50 {result.p50_ms:.2f} ms  p99 {result.p99_ms:.2f} ms  "
                    f"cpu {result.server_cpu_us:.0f} us/req  hit {result.hit_rate:.1%}  "
                    f"errors {result.errors}",
                    flush=True,
                )
    finally:
        redis_proc.stop()
    results = [_median(runs[s.name]) for s in SETUPS]
    (WORKDIR / "results.json").write_text(
        json.dumps([r.__dict__ for r in results], indent=2) + "\n"
    )
    text = report(results, args, rate, stream)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
