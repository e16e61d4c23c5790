"""Response-cache benchmark: a Zipf stream with repeats against rtserve, five cache setups.

A request is one of ``hot`` inputs drawn with Zipf(``exponent``) popularity or a one-off
input, mixed so that the stream's repeat rate (the best hit rate any cache could reach) is
``repeat``. rtserve starts afresh per setup (no cache, L1, L2 = Redis, L1+L2, L1+L2 restarted
on a warm Redis); wrk walks the stream with a Lua script that counts the ``x-rtserve-cache``
header. ``--model mlp`` (transport-bound), ``minilm`` (compute-bound) or ``all``; ``--quick``:
one short round. Results: docs/benchmarks-cache.md (one section per model between marker
comments) and bench/.work/cache/results*.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import machine, procs, servers
from bench.clients import wrk
from bench.procs import RedisServer, cpu_seconds
from bench.report import fmt_ms, fmt_ratio, fmt_rps, markdown_table
from bench.results import Measurement
from bench.workloads import MINILM, MINILM_SEQ_LEN, MLP, ROOT, WORK, Workload

WORKDIR = WORK / "cache"
DOC = ROOT / "docs" / "benchmarks-cache.md"
SENTENCES = ROOT / "examples" / "data" / "sentences.txt"
CACHE_HEADER = "x-rtserve-cache"
MODELS = ("mlp", "minilm")

_LUA = r"""
-- args: host:port, file of hot bodies (one per line), stream file (one int per line:
-- 0 = a one-off input, k = hot input k), one-off body prefix file, suffix file, and the
-- first one-off number (distinct per run, so no run sees another run's one-offs). A one-off
-- body is prefix .. __FRESH__ .. suffix (the number itself, or for MiniLM two token ids
-- derived from it).
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
  return wrk.format("POST", "/v2/models/__MODEL__/infer", headers, prefix .. __FRESH__ .. suffix)
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
- The MLP is transport-bound (a few µs per row): a hit saves the batcher's wait and the model
  run but still pays HTTP, the key (BLAKE2b over the 1 KB input) and the L1 lookup.
- L2 costs a Redis round trip on every L1 miss (reads batched per event-loop turn as one MGET,
  writes pipelined); it earns its keep across replicas and restarts (the *restarted* row).
- "server CPU µs/req" is rtserve's own CPU per answer, steadier than req/s on a shared machine.
"""

MINILM_NOTES = """\
How to read it:
- MiniLM is compute-bound (milliseconds per row): a hit saves almost the whole request, so
  throughput follows the miss rate, up to 1 / (1 - hit rate) times.
- p99 is set by the misses, which still wait for a batch.
- "best possible" is the repeat rate of the requests that setup sent (the hit rate of a cache
  starting empty); the *restarted* row can beat it, Redis already holding the hot inputs.
- "server CPU µs/req" is rtserve's own CPU per answer, steadier than req/s on a shared machine.
"""


@dataclass(frozen=True)
class ModelSpec:
    """What differs between the two workloads of this benchmark."""

    name: str
    workload: Workload
    title: str
    describe: str  # the hot inputs, for the report ("2000 hot MLP inputs (256 FP32)")
    connections: int
    length: tuple[int, int]  # stream length: (quick, full)
    duration: tuple[int, int]  # seconds per setup: (quick, full)
    hot: int
    fresh_lua: str  # Lua expression that turns the one-off number into the body's slot
    notes: str


SPECS = {
    "mlp": ModelSpec(
        name="mlp",
        workload=MLP,
        title="Response cache (Zipf stream with repeats)",
        describe="{hot} hot MLP inputs (256 FP32)",
        connections=32,
        length=(100_000, 300_000),
        duration=(5, 10),
        hot=2000,
        fresh_lua="fresh",
        notes=NOTES,
    ),
    "minilm": ModelSpec(
        name="minilm",
        workload=MINILM,
        title="Response cache on MiniLM, a compute-bound model (Zipf stream with repeats)",
        describe=(
            "{hot} hot sentences (examples/data/sentences.txt, tokenized to "
            f"{MINILM_SEQ_LEN} INT64 tokens) for all-MiniLM-L6-v2"
        ),
        connections=8,
        length=(5_000, 15_000),
        duration=(8, 18),
        hot=300,
        # Two token ids in 1000..20999 (ordinary word pieces), distinct for every number
        # below 20000**2; one-offs of a run are numbered from (run + 1) * ONE_OFFS_PER_RUN.
        fresh_lua=(
            'string.format("%d,%d", 1000 + fresh % 20000, 1000 + math.floor(fresh / 20000) % 20000)'
        ),
        notes=MINILM_NOTES,
    ),
}


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
    # One-off bodies: the spare row with its first value replaced by a counter (large, so it
    # never equals a hot row, whose values lie in [-1, 1]).
    rest = ",".join(f"{v:.4f}" for v in _row(rows[hot][1:]))
    prefix = '{"inputs":[{"name":"input","shape":[1,256],"datatype":"FP32","data":['
    return _lua_files(folder, lines, stream, prefix, f",{rest}]}}]}}")


def _lua_files(
    folder: Path, hot: list[str], stream: np.ndarray, prefix: str, suffix: str
) -> list[str]:
    """The files the Lua script reads (hot bodies, the stream, one-off prefix and suffix)."""
    texts = ("\n".join(hot) + "\n", "\n".join(str(int(k)) for k in stream) + "\n", prefix, suffix)
    paths = [folder / name for name in ("hot.txt", "stream.txt", "prefix.txt", "suffix.txt")]
    for path, text in zip(paths, texts, strict=True):
        path.write_text(text)
    return [str(p) for p in paths]


def model_dir(spec: ModelSpec) -> Path:
    """Where a model's stream, Lua script and runs live (the MLP's where they always were)."""
    return WORKDIR if spec.name == "mlp" else WORKDIR / spec.name


def sentences() -> list[str]:
    """Distinct sentences of examples/data/sentences.txt ('#' lines and blanks skipped)."""
    seen: dict[str, None] = {}
    for line in SENTENCES.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            seen.setdefault(line, None)
    return list(seen)


def _minilm_body(names: tuple[str, ...], feeds: dict[str, np.ndarray], i: int) -> str:
    inputs = []
    for name in names:
        row = feeds[name][i] if name in feeds else np.zeros(MINILM_SEQ_LEN, dtype=np.int64)
        data = [int(v) for v in row]
        inputs.append(
            {"name": name, "shape": [1, MINILM_SEQ_LEN], "datatype": "INT64", "data": data}
        )
    return orjson.dumps({"inputs": inputs}).decode()


def write_minilm_inputs(folder: Path, stream: np.ndarray, hot: int, seed: int) -> list[str]:
    """The MiniLM counterpart of :func:`write_inputs`: hot bodies are tokenized sentences."""
    from rtserve.optimize.text import minilm_tokenize

    names = tuple(spec.name for spec in MINILM.inputs)
    pool = sentences()
    order = np.random.default_rng(seed + 1).permutation(len(pool))
    feeds = minilm_tokenize([pool[i] for i in order], seq_len=MINILM_SEQ_LEN)
    # Keep sentences whose token rows differ (truncation to seq_len could merge two).
    keys = [feeds["input_ids"][i].tobytes() for i in range(len(pool))]
    keep = [i for i, key in enumerate(keys) if keys.index(key) == i]
    if len(keep) < hot + 1:
        raise SystemExit(
            f"--hot {hot}: {SENTENCES} has {len(keep)} distinct sentences (need hot + 1)"
        )
    feeds = {k: v[keep[: hot + 1]] for k, v in feeds.items()}
    lines = [_minilm_body(names, feeds, i) for i in range(hot)]
    # One-off bodies: the spare sentence with two token ids made from the one-off number
    # inserted after [CLS] (tokenized to seq_len - 2, so the row stays seq_len long).
    spare = minilm_tokenize([pool[order[keep[hot]]]], seq_len=MINILM_SEQ_LEN - 2)
    marks = (-7_777_777, -7_777_778)
    template = {
        "input_ids": np.concatenate(
            [spare["input_ids"][:, :1], [marks], spare["input_ids"][:, 1:]], 1
        ),
        "attention_mask": np.concatenate([[[1, 1, 1]], spare["attention_mask"][:, 1:]], 1),
    }
    prefix, suffix = _minilm_body(names, template, 0).split(f"{marks[0]},{marks[1]}")
    return _lua_files(folder, lines, stream, prefix, suffix)


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


def scrape(base: str, metric: str) -> float:
    """Sum of every sample of ``metric`` on /metrics (0 when absent)."""
    return sum(value for name, _, value in procs.metrics(base) if name == metric)


# One-off inputs of run n are numbered from (n + 1) * ONE_OFFS_PER_RUN: exact in FP32 (< 2**24)
# for 80 runs of up to 200k one-offs each.
ONE_OFFS_PER_RUN = 200_000


def measure(
    setup: Setup,
    args: argparse.Namespace,
    redis_proc: RedisServer,
    lua_args: list[str],
    run_no: int,
    spec: ModelSpec = SPECS["mlp"],
) -> Result:
    """One setup: a fresh rtserve with this setup's cache, wrk walking the stream."""
    folder = model_dir(spec) / "runs" / re.sub(r"[^a-z0-9]+", "-", setup.name.lower()).strip("-")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if not setup.warm_redis:
        redis_proc.flush()
    config = cache_config(setup, redis_proc.url, args.l1_bytes)
    running = servers.start(RTSERVE, spec.workload, folder, model_config=config)
    try:
        host = running.base_url.removeprefix("http://")
        base = Measurement("rtserve", spec.name, "wrk-zipf", "closed", args.connections)
        cpu_before = cpu_seconds(running.server.pid)
        point = wrk.measure(
            running.url(spec.workload.model_name), model_dir(spec) / "zipf.lua",
            args.connections, args.duration, base,
            script_args=[host, *lua_args, str((run_no + 1) * ONE_OFFS_PER_RUN)],
        )  # fmt: skip
        cpu = cpu_seconds(running.server.pid) - cpu_before
        counts = point.extra.get("counts")
        if point.error or not counts:
            raise RuntimeError(f"{setup.name}: wrk gave no result ({point.error or 'no counts'})")
        redis_errors = (
            scrape(running.base_url, "rtserve_cache_redis_errors_total") if setup.redis else 0.0
        )
    finally:
        servers.stop(running)
    return Result(
        setup=setup.name,
        rps=point.rps,
        p50_ms=point.p50_ms or 0.0,
        p99_ms=point.p99_ms or 0.0,
        requests=point.requests,
        errors=point.errors,
        tiers={k: int(counts.get(k, 0)) for k in ("memory", "redis", "miss", "bypass", "none")},
        redis_errors=redis_errors,
        server_cpu_us=cpu / max(1, point.requests) * 1e6,
    )


def _median(results: list[Result]) -> Result:
    """The round with the median throughput (its latencies and hit counts come with it)."""
    ordered = sorted(results, key=lambda r: r.rps)
    return ordered[(len(ordered) - 1) // 2]


# ----------------------------------------------------------------------------- report
def walked_repeat_rate(stream: np.ndarray, sent: int) -> float:
    """Repeat rate of the first ``sent`` requests of the looped stream (one-offs never repeat)."""
    if sent <= 0:
        return 0.0
    return repeat_rate(np.resize(stream, sent))


def report(
    results: list[Result],
    args: argparse.Namespace,
    rate: float,
    stream: np.ndarray,
    spec: ModelSpec = SPECS["mlp"],
) -> str:
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


def _markers(model: str) -> tuple[str, str]:
    return f"<!-- cache_zipf:{model}:begin -->", f"<!-- cache_zipf:{model}:end -->"


def update_doc(existing: str, model: str, text: str) -> str:
    """The page with ``model``'s section (between marker comments) set to ``text``; the rest kept."""
    begin, end = _markers(model)
    section = f"{begin}\n{text.rstrip()}\n{end}\n"
    if begin in existing and end in existing:
        head, rest = existing.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        return head + section + ("\n" + tail if tail.strip() else "")
    if not existing.strip():
        return section
    later = [_markers(m)[0] for m in MODELS[MODELS.index(model) + 1 :]]
    for marker in later:  # keep the sections in MODELS order
        if marker in existing:
            head, tail = existing.split(marker, 1)
            return head + section + "\n" + marker + tail
    return existing.rstrip("\n") + "\n\n" + section


def run_model(spec: ModelSpec, args: argparse.Namespace) -> str:
    """Every setup of one model, ``args.rounds`` times; returns the page section."""
    folder = model_dir(spec)
    folder.mkdir(parents=True, exist_ok=True)
    stream, rate = stream_for(args.length, args.hot, args.exponent, args.repeat, args.seed)
    spec.workload.model_path()  # build the model once, outside the timed runs
    if spec.name == "mlp":
        lua_args = write_inputs(folder, stream, args.hot, args.seed)
    else:
        lua_args = write_minilm_inputs(folder, stream, args.hot, args.seed)
    lua = _LUA.replace("__MODEL__", spec.workload.model_name).replace("__HEADER__", CACHE_HEADER)
    (folder / "zipf.lua").write_text(lua.replace("__FRESH__", spec.fresh_lua))
    print(f"{spec.name}: stream of {len(stream)} requests, repeat rate {rate:.1%}", flush=True)

    redis_proc = RedisServer(WORKDIR)
    runs: dict[str, list[Result]] = {s.name: [] for s in SETUPS}
    done: list[Result] = []
    try:
        for round_no in range(args.rounds):
            for setup in SETUPS:
                result = measure(setup, args, redis_proc, lua_args, len(done), spec)
                result.best_rate = walked_repeat_rate(stream, result.requests)
                done.append(result)
                runs[setup.name].append(result)
                print(
                    f"{spec.name} round {round_no + 1} {setup.name:>18}: "
                    f"{result.rps:8,.0f} req/s  "
                    f"p50 {result.p50_ms:.2f} ms  p99 {result.p99_ms:.2f} ms  "
                    f"cpu {result.server_cpu_us:.0f} us/req  hit {result.hit_rate:.1%} "
                    f"(best {result.best_rate:.1%})  errors {result.errors}",
                    flush=True,
                )
    finally:
        redis_proc.stop()
    results = [_median(runs[s.name]) for s in SETUPS]
    name = "results.json" if spec.name == "mlp" else f"results-{spec.name}.json"
    (WORKDIR / name).write_text(json.dumps([r.__dict__ for r in results], indent=2) + "\n")
    return report(results, args, rate, stream, spec)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.cache_zipf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add = parser.add_argument
    add("--model", choices=(*MODELS, "all"), default="mlp", help="mlp, minilm, or all (in turn)")
    add("--quick", action="store_true", help="short runs, one round")
    add("--repeat", type=float, default=0.5, help="target repeat rate (0-1)")
    add("--hot", type=int, help="distinct repeating inputs (mlp 2000, minilm 300)")
    add("--exponent", type=float, default=1.0, help="Zipf exponent")
    add("--length", type=int, help="stream length (mlp 300000 / quick 100000; minilm 15000 / 5000)")
    add("--duration", type=int, help="seconds per setup (mlp 10 / quick 5; minilm 18 / 8)")
    add("--rounds", type=int, help="rounds (3, quick 1)")
    add("--connections", type=int, help="wrk connections (mlp 32, minilm 8)")
    add("--l1-bytes", type=int, default=256 * 1024 * 1024, help="L1 max_bytes")
    add("--seed", type=int, default=0)
    add("--out", type=Path, default=DOC)
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (make system-deps installs it)", file=sys.stderr)
        return 2

    WORKDIR.mkdir(parents=True, exist_ok=True)
    models = MODELS if args.model == "all" else (args.model,)
    for model in models:
        spec = SPECS[model]
        margs = argparse.Namespace(**vars(args))
        margs.argv = argv
        margs.length = args.length or spec.length[0 if args.quick else 1]
        margs.duration = args.duration or spec.duration[0 if args.quick else 1]
        margs.rounds = args.rounds or (1 if args.quick else 3)
        margs.hot = args.hot or spec.hot
        margs.connections = args.connections or spec.connections
        text = run_model(spec, margs)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        existing = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        args.out.write_text(update_doc(existing, model, text), encoding="utf-8")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
