"""Response-cache benchmark: a Zipf stream with repeats against rtserve, five cache setups.

A request is one of ``hot`` inputs drawn with Zipf popularity or a one-off input, mixed so
that the stream's repeat rate (the best hit rate any cache could reach) is 50%. rtserve
starts afresh per setup (no cache, L1, L2 = Redis, L1+L2, L1+L2 restarted on a warm Redis);
wrk walks the stream with a Lua script that counts the ``x-rtserve-cache`` header.
``--model mlp`` (transport-bound), ``minilm`` (compute-bound) or ``all``; ``--quick``: one
short round. Results: docs/benchmarks-cache.md, one section per model (``results.write_section``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import machine, procs, results, servers
from bench.clients import wrk
from bench.procs import RedisServer, cpu_seconds
from bench.report import fmt_ms, fmt_ratio, fmt_rps, markdown_table
from bench.results import Measurement
from bench.workloads import MINILM, MINILM_SEQ_LEN, MLP, ROOT, WORK, Workload

WORKDIR = WORK / "cache"
DOC = ROOT / "docs" / "benchmarks-cache.md"
SENTENCES = ROOT / "examples" / "data" / "sentences.txt"
MODELS = ("mlp", "minilm")
REPEAT, EXPONENT, SEED = 0.5, 1.0, 0  # target repeat rate, Zipf exponent, stream seed
L1_BYTES = 256 * 1024 * 1024
# One-off inputs of run n are numbered from (n + 1) * ONE_OFFS_PER_RUN: exact in FP32 (< 2**24)
# for 80 runs of up to 200k one-offs each, and no run sees another run's one-offs.
ONE_OFFS_PER_RUN = 200_000

# args: host:port, hot bodies (one a line), the stream (one int a line: 0 = a one-off input,
# k = hot input k), the one-off body's prefix and suffix files, the first one-off number.
_LUA = (
    r"""
local reqs, stream, pos, fresh, headers, prefix, suffix = {}, {}, 0, 0, {}
counts = {memory = 0, redis = 0, miss = 0, bypass = 0, none = 0}

local function slurp(path)
  local f = assert(io.open(path, "rb")); local s = f:read("*a"); f:close(); return s
end

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
  return wrk.format("POST", "/v2/models/__MODEL__/infer", headers, prefix .. __FRESH__ .. suffix)
end

function response(status, hdrs, body)
  local c = hdrs["x-rtserve-cache"]
  if c == nil then c = "none" else c = c:gsub("^hit%-", "") end
  if counts[c] == nil then c = "none" end
  counts[c] = counts[c] + 1
end
"""
    + wrk.DONE_HOOK
)


# ----------------------------------------------------------------------------- the inputs
def _mlp_bodies(hot: int, seed: int) -> tuple[list[str], str, str]:
    """``hot`` MLP bodies and the one-off body's prefix and suffix: the spare row with its
    first value a counter (large, so never equal to a hot row, whose values lie in [-1, 1])."""
    rng = np.random.default_rng(seed + 1)
    rows = rng.uniform(-1.0, 1.0, size=(hot + 1, 256)).astype(np.float32).astype(float).round(4)
    tensor = {"name": "input", "shape": [1, 256], "datatype": "FP32"}
    lines = [
        orjson.dumps({"inputs": [{**tensor, "data": r.tolist()}]}).decode() for r in rows[:hot]
    ]
    rest = ",".join(f"{v:.4f}" for v in rows[hot][1:])
    prefix = '{"inputs":[{"name":"input","shape":[1,256],"datatype":"FP32","data":['
    return lines, prefix, f",{rest}]}}]}}"


def _minilm_body(feeds: dict[str, np.ndarray], i: int) -> str:
    """One MiniLM body from row ``i`` of ``feeds`` (inputs it lacks: zeros)."""
    tensors = []
    for name in (spec.name for spec in MINILM.inputs):
        row = feeds[name][i] if name in feeds else [0] * MINILM_SEQ_LEN
        data = [int(v) for v in row]
        tensors.append(
            {"name": name, "shape": [1, MINILM_SEQ_LEN], "datatype": "INT64", "data": data}
        )
    return orjson.dumps({"inputs": tensors}).decode()


def _minilm_bodies(hot: int, seed: int) -> tuple[list[str], str, str]:
    """``hot`` tokenized sentences of examples/data/sentences.txt, and the one-off body's
    prefix and suffix: the spare sentence with two token ids inserted after [CLS]."""
    from rtserve.optimize.text import minilm_tokenize

    lines = (s.strip() for s in SENTENCES.read_text(encoding="utf-8").splitlines())
    pool = list(dict.fromkeys(s for s in lines if s and not s.startswith("#")))
    order = np.random.default_rng(seed + 1).permutation(len(pool))
    feeds = minilm_tokenize([pool[i] for i in order], seq_len=MINILM_SEQ_LEN)
    # Keep sentences whose token rows differ (truncation to seq_len could merge two).
    keys = [row.tobytes() for row in feeds["input_ids"]]
    keep = [i for i, key in enumerate(keys) if keys.index(key) == i]
    if len(keep) < hot + 1:
        raise SystemExit(f"{SENTENCES} has {len(keep)} distinct sentences (need {hot + 1})")
    feeds = {k: v[keep[: hot + 1]] for k, v in feeds.items()}
    spare = minilm_tokenize([pool[order[keep[hot]]]], seq_len=MINILM_SEQ_LEN - 2)
    marks = (-7_777_777, -7_777_778)
    ids, mask = spare["input_ids"], spare["attention_mask"]
    template = {
        "input_ids": np.concatenate([ids[:, :1], [marks], ids[:, 1:]], 1),
        "attention_mask": np.concatenate([[[1, 1, 1]], mask[:, 1:]], 1),
    }
    prefix, suffix = _minilm_body(template, 0).split(f"{marks[0]},{marks[1]}")
    return [_minilm_body(feeds, i) for i in range(hot)], prefix, suffix


@dataclass(frozen=True)
class ModelSpec:
    """What differs between the two workloads of this benchmark."""

    name: str
    workload: Workload
    title: str
    describe: str  # the hot inputs, for the report
    bodies: Callable[[int, int], tuple[list[str], str, str]]
    fresh_lua: str  # Lua expression that turns the one-off number into the body's slot
    connections: int
    hot: int
    length: tuple[int, int]  # stream length: (quick, full)
    duration: tuple[int, int]  # seconds per setup: (quick, full)
    notes: str


_CPU_NOTE = '- "server CPU µs/req" is rtserve\'s own CPU per answer, steadier than req/s here.\n'
SPECS = {
    "mlp": ModelSpec(
        "mlp", MLP, "Response cache (Zipf stream with repeats)", "{hot} hot MLP inputs (256 FP32)",
        _mlp_bodies, "fresh", connections=32, hot=2000, length=(100_000, 300_000), duration=(5, 10),
        notes="How to read it:\n"
        "- The MLP is transport-bound (µs per row): a hit saves the batcher's wait and the model\n"
        "  run but still pays HTTP, the key (BLAKE2b over the 1 KB input) and the L1 lookup.\n"
        "- L2 costs a Redis round trip on every L1 miss (reads batched per event-loop turn,\n"
        "  writes pipelined); it earns its keep across replicas and restarts (*restarted*).\n"
        + _CPU_NOTE,
    ),
    "minilm": ModelSpec(
        "minilm", MINILM, "Response cache on MiniLM, a compute-bound model (Zipf stream with repeats)",
        f"{{hot}} hot sentences (examples/data/sentences.txt, {MINILM_SEQ_LEN} INT64 tokens) for "
        "all-MiniLM-L6-v2", _minilm_bodies,
        # Two ordinary word-piece ids in 1000..20999, distinct for every number below 20000**2.
        'string.format("%d,%d", 1000 + fresh % 20000, 1000 + math.floor(fresh / 20000) % 20000)',
        connections=8, hot=300, length=(5_000, 15_000), duration=(8, 18),
        notes="How to read it:\n"
        "- MiniLM is compute-bound (ms per row): a hit saves almost the whole request, so\n"
        "  throughput follows the miss rate, up to 1 / (1 - hit rate) times; misses set p99.\n"
        "- \"best possible\": the repeat rate of the requests that setup sent; *restarted* can\n"
        "  beat it, Redis already holding the hot inputs.\n" + _CPU_NOTE,
    ),
}  # fmt: skip


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
    best_rate: float = 0.0  # repeat rate of the requests this run sent (its best hit rate)

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
    return (len(hot) - len(np.unique(hot))) / len(stream) if len(stream) else 0.0


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


# ----------------------------------------------------------------------------- one run
def cache_config(setup: Setup, redis_url: str, l1_bytes: int) -> dict[str, Any]:
    """The ``response_cache`` section of rtserve's model config for ``setup`` (empty: none)."""
    cache: dict[str, Any] = {}
    if setup.memory:
        cache["memory"] = {"max_bytes": l1_bytes, "ttl_s": 600}
    if setup.redis:
        cache["redis"] = {"url": redis_url, "ttl_s": 600, "namespace": "bench"}
    return {"response_cache": cache} if cache else {}


# MiniLM warms up batches of 32 at start: allow more than the suite's default on a busy machine.
RTSERVE = replace(servers.PEERS["rtserve"], start_timeout_s=90.0)


def measure(
    setup: Setup, args: argparse.Namespace, redis: RedisServer, lua_args: list[str], run_no: int,
    spec: ModelSpec,
) -> Result:  # fmt: skip
    """One setup: a fresh rtserve with this setup's cache, wrk walking the stream."""
    folder = WORKDIR / spec.name / re.sub(r"[^a-z0-9]+", "-", setup.name.lower()).strip("-")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if not setup.warm_redis:
        redis.flush()
    config = cache_config(setup, redis.url, L1_BYTES)
    running = servers.start(RTSERVE, spec.workload, folder, model_config=config)
    try:
        host = running.base_url.removeprefix("http://")
        base = Measurement("rtserve", spec.name, "wrk-zipf", "closed", args.connections)
        cpu_before = cpu_seconds(running.server.pid)
        point = wrk.measure(
            running.url(spec.workload.model_name), WORKDIR / spec.name / "zipf.lua",
            args.connections, args.duration, base,
            script_args=[host, *lua_args, str((run_no + 1) * ONE_OFFS_PER_RUN)],
        )  # fmt: skip
        cpu = cpu_seconds(running.server.pid) - cpu_before
        counts = point.extra.get("counts")
        if point.error or not counts:
            raise RuntimeError(f"{setup.name}: wrk gave no result ({point.error or 'no counts'})")
        redis_errors = sum(
            value
            for name, _, value in procs.metrics(running.base_url)
            if name == "rtserve_cache_redis_errors_total"
        )
    finally:
        servers.stop(running)
    tiers = {k: int(counts.get(k, 0)) for k in ("memory", "redis", "miss", "bypass", "none")}
    return Result(setup.name, point.rps or 0.0, point.p50_ms or 0.0, point.p99_ms or 0.0,
                  point.requests, point.errors, tiers, redis_errors,
                  server_cpu_us=cpu / max(1, point.requests) * 1e6)  # fmt: skip


# ----------------------------------------------------------------------------- report
def report(
    results: list[Result],
    args: argparse.Namespace,
    rate: float,
    stream: np.ndarray,
    spec: ModelSpec = SPECS["mlp"],
) -> str:
    """The model's page section: one row per setup (each the median round by throughput)."""
    base = results[0]
    one_offs = int((stream == 0).sum())
    distinct = len(np.unique(stream[stream > 0])) + one_offs
    best = spec.name != "mlp"  # the MLP table keeps its columns
    header = ["setup", "req/s", "vs no cache", "p50 ms", "p99 ms", "server CPU µs/req", "hit rate"]
    header += ["best possible"] if best else []
    header += ["L1 hits", "L2 hits", "errors", "Redis errors"]
    rows = []
    for r in results:
        row = [r.setup, fmt_rps(r.rps), fmt_ratio(r.rps / base.rps if base.rps else None),
               fmt_ms(r.p50_ms), fmt_ms(r.p99_ms), f"{r.server_cpu_us:.0f}", f"{r.hit_rate:.1%}"]  # fmt: skip
        row += [f"{r.best_rate:.1%}"] if best else []
        row += [f"{r.tiers.get('memory', 0):,}", f"{r.tiers.get('redis', 0):,}", str(r.errors),
                f"{r.redis_errors:.0f}"]  # fmt: skip
        rows.append(row)
    lines = [
        f"## {spec.title}",
        "",
        f"Command: `{' '.join(['python -m bench.cache_zipf', *args.argv])}`",
        f"Machine: {machine.summary()}; load client wrk -t1 -c{args.connections} on the same "
        "machine.",
        "",
        f"Stream: {len(stream)} requests (looped for {args.duration} s per setup) over "
        f"{spec.describe.format(hot=args.hot)}, Zipf exponent {args.exponent}, with one-off inputs; "
        f"{distinct} distinct inputs in one pass, repeat rate **{rate:.1%}** (the best any cache can "
        "reach). Each setup starts a fresh rtserve and an emptied Redis (warm-up included), except "
        "*L1 + L2, restarted*: a new process on the Redis *L1 + L2* left. Hits are counted from the "
        "`x-rtserve-cache` header.",
        "",
        *markdown_table(header, rows, numeric_from=1),
    ]
    if args.rounds > 1:
        lines += ["", f"Median of {args.rounds} rounds (setups alternate within each round)."]
    return "\n".join(lines) + "\n\n" + spec.notes


def run_model(spec: ModelSpec, args: argparse.Namespace) -> str:
    """Every setup of one model, ``args.rounds`` times; returns the page section."""
    folder = WORKDIR / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    stream, rate = stream_for(args.length, args.hot, args.exponent, REPEAT, SEED)
    spec.workload.model_path()  # build the model once, outside the timed runs
    hot, prefix, suffix = spec.bodies(args.hot, SEED)
    texts = {"hot.txt": "\n".join(hot) + "\n", "stream.txt": "\n".join(map(str, stream)) + "\n",
             "prefix.txt": prefix, "suffix.txt": suffix}  # fmt: skip
    for name, text in texts.items():
        (folder / name).write_text(text)
    lua_args = [str(folder / name) for name in texts]
    lua = _LUA.replace("__MODEL__", spec.workload.model_name).replace("__FRESH__", spec.fresh_lua)
    (folder / "zipf.lua").write_text(lua)
    print(f"{spec.name}: stream of {len(stream)} requests, repeat rate {rate:.1%}", flush=True)

    redis = RedisServer(WORKDIR)
    runs: dict[str, list[Result]] = {s.name: [] for s in SETUPS}
    try:
        for round_no in range(args.rounds):
            for setup in SETUPS:
                done = sum(map(len, runs.values()))
                r = measure(setup, args, redis, lua_args, done, spec)
                r.best_rate = repeat_rate(np.resize(stream, r.requests))
                runs[setup.name].append(r)
                print(f"{spec.name} round {round_no + 1} {setup.name:>18}: {r.rps:8,.0f} req/s  "
                      f"p50 {r.p50_ms:.2f} ms  p99 {r.p99_ms:.2f} ms  cpu {r.server_cpu_us:.0f} us/req  "
                      f"hit {r.hit_rate:.1%} (best {r.best_rate:.1%})  errors {r.errors}", flush=True)  # fmt: skip
    finally:
        redis.stop()
    # Per setup the round with the median throughput (its latencies and hits come with it).
    medians = [sorted(rs, key=lambda r: r.rps)[(len(rs) - 1) // 2] for rs in runs.values()]
    results.write_json(folder / "results.json", [r.__dict__ for r in medians])
    return report(medians, args, rate, stream, spec)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = results.parser("python -m bench cache", __doc__)
    parser.add_argument(
        "--model", choices=(*MODELS, "all"), default="mlp", help="one, or all in turn"
    )
    parser.add_argument("--quick", action="store_true", help="short runs, one round")
    parser.add_argument("--out", type=Path, default=DOC, help="the page its sections go to")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (make system-deps installs it)", file=sys.stderr)
        return 2
    full = int(not args.quick)
    for model in MODELS if args.model == "all" else (args.model,):
        spec = SPECS[model]
        plan = argparse.Namespace(argv=argv, length=spec.length[full], duration=spec.duration[full],
                                  rounds=(1, 3)[full], hot=spec.hot, connections=spec.connections,
                                  exponent=EXPONENT)  # fmt: skip
        text = run_model(spec, plan)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        results.write_section(args.out, f"cache_zipf: {model}", text)
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
