"""Render ``bench.generative``'s JSON as docs/benchmarks-generative.md: medians, then every round.

python -m bench.generative_report --doc docs/benchmarks-generative.md RESULT.json
# rounds of several runs (each alternates its order) in one file and one page:
python -m bench.generative_report --merge-into bench/results/generative.json --doc D a.json b.json
The first-token objective section comes from ``bench.generative_slo``'s JSON (``--slo``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import orjson

SERVERS = ("rtserve", "vllm")
LABELS = {"rtserve": "rtserve", "vllm": "vLLM-CPU", "transformers": "transformers generate"}


def _get(node: Any, *path: str | int) -> Any:
    for key in path:
        if isinstance(node, dict):
            node = node.get(str(key) if not isinstance(key, int) else key)
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return None
    return node


def _values(result: dict[str, Any], who: str, *path: str | int) -> list[float | None]:
    """The value at ``path`` in each round (None where that round has none)."""
    found = [_get(r, who, *path) for r in result["rounds"]]
    return [v if isinstance(v, int | float) else None for v in found]


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _rounds(values: list[float | None], digits: int = 0) -> str:
    return " / ".join(_fmt(v, digits) for v in values) or "-"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _present(result: dict[str, Any]) -> list[str]:
    names = {name for r in result["rounds"] for name in r}
    return [n for n in (*SERVERS, "transformers") if n in names]


def throughput_table(result: dict[str, Any]) -> list[str]:
    plan = result["plan"]
    lines = [
        "| | "
        + " | ".join(f"{c} stream{'s' if c > 1 else ''}" for c in plan["concurrency"])
        + " |",
        "|---|" + "---:|" * len(plan["concurrency"]),
    ]
    for who in _present(result):
        cells = []
        for c in plan["concurrency"]:
            values = _values(result, who, "throughput", str(c), "tok_s")
            cells.append(f"**{_fmt(_median(values))}** ({_rounds(values)})")
        lines.append(f"| {LABELS[who]} | " + " | ".join(cells) + " |")
    return lines


def ratio_line(result: dict[str, Any]) -> str:
    top = str(result["plan"]["concurrency"][-1])
    ratios: list[float | None] = [
        a / b
        for a, b in zip(
            _values(result, "rtserve", "throughput", top, "tok_s"),
            _values(result, "vllm", "throughput", top, "tok_s"),
            strict=False,
        )
        if a is not None and b
    ]
    if not ratios:
        return "rtserve / vLLM-CPU at the top concurrency: not measured in this run."
    return (
        f"rtserve / vLLM-CPU at {top} streams: **{_median(ratios):.2f}x** "
        f"(rounds: {_rounds(ratios, 2)})."
    )


def poisson_table(result: dict[str, Any]) -> list[str]:
    plan = result["plan"]
    lines = [
        "| rate (req/s) | offered tok/s | server | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | tok/s | errors |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, rate in enumerate(plan["rates"]):
        for who in (s for s in SERVERS if s in _present(result)):
            cells = [
                _fmt(_median(_values(result, who, "poisson", i, key)))
                for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tok_s")
            ]
            errors = str(sum(v or 0 for v in _values(result, who, "poisson", i, "errors")))
            if all(_get(r, who, "poisson", i, "skipped") for r in result["rounds"]):
                cells, errors = ["-"] * 5, "not run: saturated at a lower rate"
            lines.append(
                f"| {rate:g} | {rate * plan['max_tokens']:.0f} | {LABELS[who]} | "
                + " | ".join(cells)
                + f" | {errors} |"
            )
    return lines


def prefix_table(result: dict[str, Any]) -> list[str]:
    lines = ["| server | TTFT p50, unique system prompt | TTFT p50, shared system prompt |"]
    lines.append("|---|---:|---:|")
    for who in (s for s in SERVERS if s in _present(result)):
        cold = _values(result, who, "prefix", "cold", "ttft_p50_ms")
        warm = _values(result, who, "prefix", "warm", "ttft_p50_ms")
        lines.append(
            f"| {LABELS[who]} | {_fmt(_median(cold), 1)} ms ({_rounds(cold, 1)}) "
            f"| {_fmt(_median(warm), 1)} ms ({_rounds(warm, 1)}) |"
        )
    return lines


SLO_LABELS = {
    "rtserve-objective": "rtserve, `ttft_p99_ms: {objective:g}`",
    "rtserve": "rtserve, no objective (queues, as vLLM does)",
    "vllm": "vLLM-CPU (queues)",
}


def objective_section(slo: dict[str, Any]) -> list[str]:
    """``bench.generative_slo``'s rounds: admitted / refused, refusal time, admitted TTFT."""
    objective = slo["objective_ms"]
    rounds = slo["rounds"]
    names = [n for n in SLO_LABELS if any(n in r for r in rounds)]
    first = next(iter(rounds[0].values()), {})
    rate, requests = first.get("rate", 0), first.get("requests", 0)
    lines = [
        "## The first-token objective past saturation",
        "",
        f"Poisson arrivals at {rate:g} requests/s ({requests} requests of "
        f"{slo.get('max_tokens', 128)} tokens; about twice what rtserve finishes at 32 "
        f"streams) to rtserve with `slo: {{ttft_p99_ms: {objective:g}}}` and without it, in "
        f"alternating order over {_count(len(rounds), 'round')}. Medians; every round in "
        "brackets.",
        "",
        "| server | admitted | refused (429) | refusal p50 / p99 ms | admitted TTFT p50 ms "
        "| admitted TTFT p99 ms | slowest admitted TTFT ms | tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    wrapped = {"rounds": rounds}
    for who in names:

        def cell(key: str, digits: int = 0, who: str = who) -> str:
            values = _values(wrapped, who, key)
            return f"{_fmt(_median(values), digits)} ({_rounds(values, digits)})"

        refusal = (
            f"{_fmt(_median(_values(wrapped, who, 'refusal_p50_ms')), 1)} / "
            f"{_fmt(_median(_values(wrapped, who, 'refusal_p99_ms')), 1)}"
        )
        lines.append(
            f"| {SLO_LABELS[who].format(objective=objective)} | {cell('admitted')} | "
            f"{cell('refused_429')} | {refusal} | {cell('ttft_p50_ms')} | "
            f"{cell('ttft_p99_ms')} | {cell('ttft_max_ms')} | {cell('tok_s')} |"
        )
    if "rtserve-objective" in names:
        p99 = _values(wrapped, "rtserve-objective", "ttft_p99_ms")
        within = sum(1 for v in p99 if v is not None and v <= objective)
        late = [
            f"{sum(1 for t in r['rtserve-objective'].get('ttft_ms', []) if t > objective)} of "
            f"{r['rtserve-objective'].get('admitted', 0)}"
            for r in rounds
            if "ttft_ms" in r.get("rtserve-objective", {})
        ]
        lines += [
            "",
            f"Admitted TTFT p99 within the {objective:g} ms objective in {within} of "
            f"{len(p99)} rounds"
            + (
                f"; admitted requests whose first token came later: {' / '.join(late)}."
                if late
                else "."
            ),
        ]
    lines += ["", f"Command: `{slo['command']}` (raw: `bench/results/generative-slo.json`)."]
    return lines


def _bind_text(bind: str) -> str:
    if bind == "auto":
        return (
            "OpenMP threads bound by vLLM's default (auto: one thread on core 0, core 1 left "
            "to its API server)"
        )
    return (
        f"OpenMP threads on cores {bind} (`VLLM_CPU_OMP_THREADS_BIND={bind}`, no core reserved: "
        "its fastest setting here; its default leaves one core to the API server and made "
        "216 tok/s at 32 streams in an earlier run, `bench/results/generative-throughput.json`)"
    )


def _setup_lines(result: dict[str, Any]) -> list[str]:
    present = _present(result)
    lines = []
    if "vllm" in present:
        lines.append(
            f"- vLLM-CPU {result['versions'].get('vllm')} in `bench/.peers/vllm` (`python -m "
            "bench.envs vllm`), its OpenAI server with `--dtype float32 --max-model-len 2048 "
            f"--max-num-seqs 64`, KV cache 1 GiB, {_bind_text(result.get('vllm_bind', 'auto'))}, "
            "prefix caching on (its default)."
        )
    if "rtserve" in present:
        lines.append(
            "- rtserve: `rtserve serve --model-repository examples/llm-repository`, the "
            "example's `config.yaml` (max_num_seqs 64, KV pool 512 MiB, block 8, 512 batched "
            "tokens per step, prefix caching on)."
        )
    if "transformers" in present:
        lines.append(
            "- transformers: `model.generate` (greedy, `min_new_tokens` = `max_new_tokens`, "
            f"left padding), {result['plan'].get('hf_threads', 2)} torch thread(s), in a "
            "subprocess (`bench/hf_generate.py`)."
        )
    return lines


def _short_answers(result: dict[str, Any]) -> int:
    total = 0
    for r in result["rounds"]:
        for who in SERVERS:
            rows = [*(_get(r, who, "throughput") or {}).values(), *(_get(r, who, "poisson") or [])]
            total += sum(row.get("short", 0) for row in rows)
    return total


def failures(result: dict[str, Any]) -> list[str]:
    return [
        f"- round {i + 1}, {LABELS.get(who, who)}: {row['error']}"
        for i, r in enumerate(result["rounds"])
        for who, row in r.items()
        if isinstance(row, dict) and row.get("error")
    ]


def render(result: dict[str, Any], slo: dict[str, Any] | None = None) -> str:
    plan = result["plan"]
    facts = result["machine"]
    out = [
        "# Generative serving: rtserve, vLLM on CPU and transformers",
        "",
        f'{result["model"]}, greedy, chat messages "Write a short story number i about a cat.",'
        f" {plan['max_tokens']} new tokens per request (`ignore_eos`), streamed over SSE. Servers "
        f"run one at a time in alternating order over {_count(len(result['rounds']), 'round')}; "
        "the bold "
        "number is the median, every round follows in brackets.",
        "",
        "## Output tokens/s",
        "",
        "Closed loop: each stream sends its next request when the last one ends. transformers "
        "runs `generate` on a static batch of that size in-process (no server, no HTTP).",
        "",
        *throughput_table(result),
        "",
        ratio_line(result),
        "",
        "At 32 streams both engines run the model's FP32 GEMMs (540 MB of weights) every "
        "decode step, about three quarters of rtserve's step here. rtserve's lead comes from "
        "the rest: fused CPU kernels for norms, RoPE and attention, 8-token blocks that share "
        "more of the chat template's prefix, and a greedy LM head screened in bfloat16 whose "
        "argmax stays FP32's (docs/generative.md, how a step is scheduled).",
        "",
        "## Latency under Poisson arrivals",
        "",
        f"Open loop, about {plan['poisson_seconds']:g} s of exponential gaps per rate (at least 8 "
        "requests), the same rates for every server. TTFT: from sending to the first content "
        "chunk; ITL: gaps between content chunks; milliseconds, medians over rounds.",
        "",
        *poisson_table(result),
        "",
        "## Prefix caching",
        "",
        f"A ~400-token system prompt, one request at a time, {plan['prefix_requests']} each, "
        f"{plan['prefix_max_tokens']} new tokens: the same prompt every time (after one request "
        "that fills the cache) against a prompt whose first line is unique.",
        "",
        *prefix_table(result),
        "",
        *([*objective_section(slo), ""] if slo else []),
        "## How it ran",
        "",
        f"- Command: `{result['command']}` (`make bench-generative`).",
        f"- Machine: {facts.get('cpu')}, {facts.get('cores')} cores, {facts.get('memory')}, "
        f"no GPU; load average at start {facts.get('load average at start')}.",
        *_setup_lines(result),
        "- Raw rounds: `bench/results/generative.json`.",
    ]
    short = _short_answers(result)
    if short:
        out += ["", f"{short} answers ended before {plan['max_tokens']} tokens (EOS not ignored)."]
    failed = failures(result)
    if failed:
        out += ["", "## Failures in this run", "", *failed]
    return "\n".join(out) + "\n"


SLO_RESULTS = Path(__file__).resolve().parent / "results" / "generative-slo.json"


def write(result: dict[str, Any], path: Path, slo_path: Path | None = SLO_RESULTS) -> None:
    """The page, with the objective section from ``slo_path`` when that file exists."""
    slo = orjson.loads(slo_path.read_bytes()) if slo_path and slo_path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(result, slo))


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result holding every run's rounds, in order; the first run's plan and machine."""
    merged = dict(results[0])
    merged["rounds"] = [r for result in results for r in result["rounds"]]
    merged["command"] = " ; ".join(result["command"] for result in results)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--doc", type=Path, required=True)
    parser.add_argument("--merge-into", type=Path, help="write the merged JSON here")
    parser.add_argument(
        "--slo", type=Path, default=SLO_RESULTS,
        help="bench.generative_slo's JSON for the objective section (default: %(default)s)",
    )  # fmt: skip
    args = parser.parse_args()
    result = merge([orjson.loads(p.read_bytes()) for p in args.results])
    if args.merge_into:
        args.merge_into.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    write(result, args.doc, args.slo)


if __name__ == "__main__":
    main()
