"""OpenAI API features against their plain counterparts on one server, alternating rounds.

``structured``: SmolLM2-135M (``examples/llm-repository/smollm2``, FP32) at 32 concurrent
streams, the same chat prompts with a JSON-schema ``response_format`` and without (the
unconstrained ones with ``ignore_eos``; a constrained answer ends where its JSON does, so
its tokens are counted from ``usage``); output tok/s of each and their ratio. Beside it, the
mask per decode step, measured in-process: ``llm/grammar.py``'s mask for one row on
SmolLM2's 49,152-token vocabulary, applied to a logits row as the sampler does, along a
schema-valid answer.

``embeddings``: the ``text-embedding`` pipeline (``examples/repository``) through
``POST /v1/embeddings`` and through ``POST /v2/models/text-embedding/infer``, the same
sentences (one per request, rotating) at the same concurrency (wrk, closed loop); req/s,
p50 and p99 of each and the req/s ratio.

    python -m bench openai [--workloads structured,embeddings] [--rounds N] [--quick]

Results: ``bench/results/openai-<workload>.json`` and a section of
``docs/benchmarks-generative.md`` each (``--quick``: a short check; its JSON goes to
``bench/.work/`` and the page is left alone).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bench import generative, machine, procs, results
from bench.clients import wrk
from bench.clients.sse import Stream, chat_body, closed_loop
from bench.report import markdown_table
from bench.results import Measurement
from bench.stats import middle, percentile, ratio, rotated

ROOT = Path(__file__).resolve().parent.parent
LLM_MODEL = ROOT / "examples" / "llm-repository" / "smollm2"
EXAMPLES = ROOT / "examples" / "repository"
EMBEDDING_MODELS = ("minilm-tokenizer", "minilm-int8", "text-embedding")
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "bench" / ".work" / "openai"
DOC = ROOT / "docs" / "benchmarks-generative.md"

# A schema of the kind an app asks for: nested objects, an array, an enum, bounded numbers.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "mood": {"type": "string", "enum": ["happy", "sad", "curious"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "weight_kg": {"type": "number", "minimum": 0, "maximum": 20},
        "story": {"type": "string"},
        "friends": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "kind": {"type": "string"}},
                "required": ["name", "kind"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "mood", "age", "weight_kg", "story", "friends"],
    "additionalProperties": False,
}
# An answer that matches it, for the in-process mask walk (compact: the grammar's form).
ANSWER = {
    "title": "The Cat Who Stayed",
    "mood": "curious",
    "age": 4,
    "weight_kg": 4.5,
    "story": " ".join(["The cat sat by the window and watched the rain fall on the garden."] * 6),
    "friends": [{"name": "Tom", "kind": "dog"}, {"name": "Bea", "kind": "bird"}],
}


@dataclass(frozen=True)
class Plan:
    rounds: int = 3
    streams: int = 32
    requests_per_stream: int = 2  # a closed loop of streams x this many requests per side
    max_tokens: int = 128
    deadline_s: float = 300.0  # no new request after this; bounds a slow round
    embed_concurrency: int = 16
    embed_seconds: float = 15.0
    mask_walks: int = 20


QUICK = Plan(rounds=2, streams=4, requests_per_stream=1, max_tokens=16, embed_concurrency=4,
             embed_seconds=2.0, mask_walks=2)  # fmt: skip


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _alternate(
    rounds: int, sides: list[str], measure: Callable[[str], dict[str, Any]], key: str
) -> dict[str, Any]:
    """Both sides once per round, the order rotating; each round's ratio is the second
    side's ``key`` over the first's, and ``median_ratio`` the median of those."""
    entries = []
    for r in range(rounds):
        entry: dict[str, Any] = {}
        for side in rotated(sides, r):
            entry[side] = row = measure(side)
            print(f"  round {r + 1} {side}: {key} {row[key]}, errors {row['errors']}", flush=True)
        share = ratio(entry[sides[1]][key], entry[sides[0]][key])
        entry["ratio"] = None if share is None else round(share, 3)
        entries.append(entry)
    share = middle(e["ratio"] for e in entries)
    return {"rounds": entries, "median_ratio": None if share is None else round(share, 3)}


# --------------------------------------------------------------------------- structured
def story(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short story number {i} about a cat, as JSON "
             "with a title, a mood, the cat's age and weight, the story and its friends."}]  # fmt: skip


def chat(i: int, max_tokens: int, constrained: bool) -> dict[str, Any]:
    body = chat_body("smollm2", story(i), max_tokens, ignore_eos=not constrained)
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "story", "schema": SCHEMA, "strict": True},
        }
    return body


def _valid(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(doc, dict)
    try:
        jsonschema.validate(doc, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def summarize(streams: list[Stream], wall: float, constrained: bool) -> dict[str, Any]:
    """``generative.summarize``'s row, with tokens per answer and, for ``constrained``,
    how many answers ended and how many of those match the schema."""
    ok = [s for s in streams if s.error is None and s.chunks]
    row = generative.summarize(streams, wall)
    row["tokens_per_answer"] = round(row["tokens"] / len(ok), 1) if ok else None
    row["cut_at_max_tokens"] = sum(1 for s in ok if s.finish_reason == "length")
    if constrained:  # (an answer cut at max_tokens is unfinished JSON: not counted)
        ended = [s for s in ok if s.finish_reason == "stop"]
        row["ended"] = len(ended)
        row["ended_valid"] = sum(1 for s in ended if _valid(s.text))
    return row


def _serve(
    work: Path, source: Path, names: tuple[str, ...], timeout_s: float
) -> tuple[procs.Server, str]:
    """rtserve on a repository holding the models ``names`` of the example repository ``source``."""
    repo = work / "repo"
    for name in names:
        (repo / name).mkdir(parents=True, exist_ok=True)
        if not (repo / name / "1").exists():
            (repo / name / "1").symlink_to(source / name / "1")
        (repo / name / "config.yaml").write_text((source / name / "config.yaml").read_text())
    server, ports = procs.rtserve(work, "--model-repository", str(repo), timeout_s=timeout_s)
    base = f"http://127.0.0.1:{ports['http_port']}"
    server.wait_ready(base + "/v2/health/ready", timeout_s=timeout_s)
    return server, base


def measure_structured(plan: Plan, work: Path) -> dict[str, Any]:
    """Alternating rounds of 32 unconstrained and 32 schema streams on one server."""
    n = plan.streams * plan.requests_per_stream
    with procs.bench_lock():
        mask = mask_time(plan.mask_walks)  # (before the server starts: the cores are free)
        print(f"  mask per row: p50 {mask['mask_us_p50']} us, p99 {mask['mask_us_p99']} us "
              f"({mask['steps']} steps x {plan.mask_walks})", flush=True)  # fmt: skip
        server, base = _serve(work, LLM_MODEL.parent, (LLM_MODEL.name,), 600)
        url = base + "/v1/chat/completions"

        def side(name: str) -> dict[str, Any]:
            bodies = [chat(i, plan.max_tokens, name == "schema") for i in range(n)]
            streams, wall = asyncio.run(closed_loop(url, bodies, plan.streams, plan.deadline_s))
            return summarize(streams, wall, name == "schema")

        try:
            warm = [chat(i, 8, c) for i in range(4) for c in (False, True)]
            asyncio.run(closed_loop(url, warm, 4))
            result = _alternate(plan.rounds, ["plain", "schema"], side, "tok_s")
        finally:
            server.stop()
    return result | {"mask": mask, "schema": SCHEMA}


def mask_time(walks: int) -> dict[str, Any]:
    """The engine's mask for one row per decode step (``GrammarState.allowed`` and the
    sampler's ``masked_fill_`` on a logits row), along ``ANSWER`` under ``SCHEMA``, on
    SmolLM2's vocabulary; llguidance's bitmask alone beside it; the first compile."""
    import torch
    from transformers import AutoTokenizer

    from rtserve.runtime.llm.grammar import Grammars
    from rtserve.runtime.llm.params import Constraint

    version = LLM_MODEL / "1"
    tokenizer = AutoTokenizer.from_pretrained(version)
    vocab = int(json.loads((version / "config.json").read_text())["vocab_size"])
    eos = tokenizer.eos_token_id
    grammars = Grammars(tokenizer, vocab, [eos] if eos is not None else [])
    constraint = Constraint("json_schema", SCHEMA)
    try:
        grammars.state(Constraint("json_object"))  # (the token table: built once per model)
        began = time.perf_counter()
        grammars.state(constraint)
        compile_ms = (time.perf_counter() - began) * 1000
        text = json.dumps(ANSWER, separators=(",", ":"))
        ids = tokenizer.encode(text, add_special_tokens=False)
        logits = torch.randn(vocab)
        masks: list[float] = []
        bitmasks: list[float] = []
        first: list[float] = []  # (the first walk: the lexer's states built as it goes)
        steps = 0
        for walk in range(2 * walks + 1):  # (odd walks: llguidance's bitmask alone)
            state = grammars.state(constraint)
            for step, token in enumerate(ids):
                began = time.perf_counter()
                if walk % 2:
                    state.matcher.compute_bitmask()
                    bitmasks.append(time.perf_counter() - began)
                    allowed = state.allowed(vocab)
                else:
                    allowed = state.allowed(vocab)
                    if allowed is not None:
                        logits.masked_fill_(~allowed, float("-inf"))
                    (masks if walk else first).append(time.perf_counter() - began)
                if allowed is None or not bool(allowed[token]):
                    break  # (a token the grammar refuses: the walk stops here)
                state.accept(token)
                steps = max(steps, step + 1)
    finally:
        grammars.close()

    def us(values: list[float], q: float) -> float:
        return round(percentile(values, q) * 1e6, 1)

    return {
        "vocab": vocab,
        "steps": steps,
        "answer_tokens": len(ids),
        "compile_ms": round(compile_ms, 1),
        "mask_us_p50": us(masks, 50),
        "mask_us_p99": us(masks, 99),
        "mask_us_mean": round(statistics.fmean(masks) * 1e6, 1),
        "first_walk_us_mean": round(statistics.fmean(first) * 1e6, 1),
        "bitmask_us_p50": us(bitmasks, 50),
        "bitmask_us_p99": us(bitmasks, 99),
    }


# --------------------------------------------------------------------------- embeddings
def sentences() -> list[str]:
    lines = (ROOT / "examples" / "data" / "sentences.txt").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def v1_body(text: str) -> bytes:
    return orjson.dumps({"model": "text-embedding", "input": text, "encoding_format": "float"})


def v2_body(text: str) -> bytes:
    tensor = {"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [text]}
    return orjson.dumps({"inputs": [tensor]})


ROUTES: dict[str, tuple[str, Callable[[str], bytes]]] = {
    "v1": ("/v1/embeddings", v1_body),
    "v2": ("/v2/models/text-embedding/infer", v2_body),
}


def _same_vectors(base: str, text: str) -> float:
    """The largest difference between the two routes' vectors of ``text`` (0: the same)."""
    status, v1 = procs.http_post(base + ROUTES["v1"][0], v1_body(text))
    status2, v2 = procs.http_post(base + ROUTES["v2"][0], v2_body(text))
    if status != 200 or status2 != 200:
        raise RuntimeError(f"embedding routes answered {status} / {status2}: {v1[:200]!r}")
    a = orjson.loads(v1)["data"][0]["embedding"]
    b = orjson.loads(v2)["outputs"][0]["data"]
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def measure_embeddings(plan: Plan, work: Path) -> dict[str, Any]:
    texts = sentences()
    scripts = {}
    work.mkdir(parents=True, exist_ok=True)
    for route, (_, body) in ROUTES.items():
        scripts[route] = work / f"{route}.lua"
        bodies = [body(t) for t in texts]
        scripts[route].write_text(wrk.lua_script(bodies[0], rotate=bodies))

    def side(route: str, seconds: float = plan.embed_seconds) -> dict[str, Any]:
        m = wrk.measure(base + ROUTES[route][0], scripts[route], plan.embed_concurrency, seconds,
                        Measurement("rtserve", "embeddings", "wrk", route, plan.embed_concurrency))  # fmt: skip
        return {"rps": round(m.rps, 1), "p50_ms": _ms(m.p50_ms), "p99_ms": _ms(m.p99_ms),
                "requests": m.requests, "errors": m.errors, "error": m.error}  # fmt: skip

    with procs.bench_lock():
        server, base = _serve(work, EXAMPLES, EMBEDDING_MODELS, 300)
        try:
            difference = _same_vectors(base, texts[0])
            for route in ROUTES:  # (warm-up: both routes, a second each)
                side(route, 1)
            result = _alternate(plan.rounds, ["v2", "v1"], side, "rps")
        finally:
            server.stop()
    return result | {"max_vector_difference": difference, "texts": len(texts)}


# --------------------------------------------------------------------------- reports
def _header(result: dict[str, Any]) -> str:
    facts = result["machine"]
    return (
        f"`{result['command']}` (`{result['results']}`), {result['started']}, "
        f"{facts['cpu']}, {facts['cores']} cores, {facts['memory']}, load average at start "
        f"{facts['load average at start']}; {result['source']}."
    )


def structured_section(result: dict[str, Any]) -> str:
    plan, data = result["plan"], result["data"]
    mask = data["mask"]
    lines = [
        _header(result),
        "",
        f"SmolLM2-135M-Instruct FP32 (the example's config), {plan['streams']} streams, "
        f"{plan['streams'] * plan['requests_per_stream']} requests per side and round, at most "
        f"{plan['max_tokens']} new tokens, greedy; the same prompts with the schema below as "
        "`response_format` (`json_schema`, strict) and without it (with `ignore_eos`); "
        "tokens counted from `usage`. Rounds alternate which side goes first.",
        "",
    ]
    header = ["round", "unconstrained tok/s", "schema tok/s", "ratio", "schema tokens / answer",
              "schema answers ended / valid", "schema answers cut at max_tokens"]  # fmt: skip
    rows = [
        [str(i), str(e["plain"]["tok_s"]), str(e["schema"]["tok_s"]), f"{e['ratio']}x",
         str(e["schema"]["tokens_per_answer"]),
         f"{e['schema'].get('ended')} / {e['schema'].get('ended_valid')}",
         str(e["schema"]["cut_at_max_tokens"])]
        for i, e in enumerate(data["rounds"], 1)
    ]  # fmt: skip
    lines += markdown_table(header, rows, numeric_from=0)
    lines += [
        "",
        f"**Median ratio (schema / unconstrained): {data['median_ratio']}x** (goal >= 0.9x).",
        "",
        f"Mask per decode step, one row (in-process: `llm/grammar.py`'s mask and the "
        f"sampler's `masked_fill_` on a {mask['vocab']:,}-token logits row, along a "
        f"{mask['steps']}-token answer, {plan['mask_walks']} walks after a first): p50 "
        f"**{mask['mask_us_p50']} us**, p99 {mask['mask_us_p99']} us, mean "
        f"{mask['mask_us_mean']} us (llguidance's bitmask alone: p50 {mask['bitmask_us_p50']} "
        f"us, p99 {mask['bitmask_us_p99']} us); {plan['streams']} constrained rows: about "
        f"{round(mask['mask_us_mean'] * plan['streams'] / 1000, 2)} ms a step. The first "
        f"answer under a new schema (its lexer states built as it goes; not in the figures "
        f"above): mean {mask['first_walk_us_mean']} us a step. First compile of the schema: "
        f"{mask['compile_ms']} ms.",
        "",
        f"Schema: `{json.dumps(SCHEMA, separators=(',', ':'))}`",
    ]
    return "\n".join(lines)


def embeddings_section(result: dict[str, Any]) -> str:
    plan, data = result["plan"], result["data"]
    lines = [
        _header(result),
        "",
        f"The `text-embedding` pipeline (MiniLM tokenizer step + MiniLM INT8, "
        f"`examples/repository`), one sentence per request from `examples/data/sentences.txt` "
        f"({data['texts']}, rotating), wrk -t1 -c{plan['embed_concurrency']}, "
        f"{plan['embed_seconds']:g} s per side and round, `encoding_format: float` on `/v1`; "
        f"rounds alternate which route goes first. The two routes' vectors of one sentence "
        f"differ by at most {data['max_vector_difference']:.2g}.",
        "",
    ]
    header = ["round", "/v1/embeddings req/s", "p50 / p99 ms", "V2 infer req/s", "p50 / p99 ms",
              "ratio"]  # fmt: skip
    rows = [
        [str(i), str(e["v1"]["rps"]), f"{e['v1']['p50_ms']} / {e['v1']['p99_ms']}",
         str(e["v2"]["rps"]), f"{e['v2']['p50_ms']} / {e['v2']['p99_ms']}", f"{e['ratio']}x"]
        for i, e in enumerate(data["rounds"], 1)
    ]  # fmt: skip
    lines += markdown_table(header, rows, numeric_from=0)
    lines += ["", f"**Median ratio (/v1 / V2 req/s): {data['median_ratio']}x** (goal >= 0.9x)."]
    return "\n".join(lines)


SECTIONS = {"structured": structured_section, "embeddings": embeddings_section}


# --------------------------------------------------------------------------- main
WORKLOADS = {"structured": measure_structured, "embeddings": measure_embeddings}


def main(argv: list[str] | None = None) -> int:
    parser = results.parser("python -m bench openai", __doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--quick", action="store_true", help="a short end-to-end check")
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    if unknown := [n for n in names if n not in WORKLOADS]:
        parser.error(f"--workloads: unknown {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    plan = QUICK if args.quick else Plan()
    plan = replace(plan, rounds=args.rounds or plan.rounds)
    command = results.command_line("python -m bench openai", argv)
    for name in names:
        out = (WORK if args.quick else RESULTS) / f"openai-{name}.json"
        result: dict[str, Any] = {
            "suite": "openai",
            "workload": name,
            "command": command,
            "results": str(out.relative_to(ROOT)),
            "plan": asdict(plan),
            "machine": machine.facts(),
            "source": machine.source_state(),
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        print(f"{name}:", flush=True)
        result["data"] = WORKLOADS[name](plan, WORK / name)
        results.write_json(out, result)
        print(f"  -> {out.relative_to(ROOT)}: median ratio {result['data']['median_ratio']}x")
        if not args.quick:  # (a quick check leaves the page alone)
            results.write_section(DOC, f"openai: {name}", SECTIONS[name](result))
            print(f"  -> {DOC}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
