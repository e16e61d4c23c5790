"""Render a run as Markdown: settings, machine, tables per workload and client, goals, plots."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.results import Measurement
from bench.stats import median_ratio, ratio, round_ratios

CLIENT_TITLES = {
    "wrk": "wrk, V2 JSON body over HTTP/1.1",
    "openloop-json": "Poisson client (bench.clients.openloop), V2 JSON body over HTTP/1.1",
    "pa-http-binary": "perf_analyzer, V2 HTTP with binary tensors",
    "pa-http-json": "perf_analyzer, V2 HTTP with JSON tensors",
    "pa-grpc": "perf_analyzer, V2 gRPC",
}


@dataclass
class RunRecord:
    """Everything a report shows; filled by :mod:`bench.run`."""

    mode: str
    command: str
    started: str
    duration_s: float
    machine: dict[str, str]
    versions: dict[str, str]
    settings: dict[str, str]
    labels: dict[str, str]
    order: list[str]
    headline: list[Measurement] = field(default_factory=list)
    matrix: list[Measurement] = field(default_factory=list)
    limits: list[Measurement] = field(default_factory=list)
    loads: list[tuple[str, str, str]] = field(default_factory=list)
    plots: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)
    headline_rounds: list[Measurement] = field(default_factory=list)  # each round's wrk points
    baseline: str = ""  # the commit the baseline rtserve ran from, when there was one


def fmt_rps(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def fmt_ms(value: float | None) -> str:
    if value is None or value != value:
        return "—"
    if value < 1:
        return f"{value:.3f}"
    if value < 10:
        return f"{value:.2f}"
    if value < 100:
        return f"{value:.1f}"
    return f"{value:,.0f}"


def fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int | None = None
) -> list[str]:
    """A Markdown table; columns from ``numeric_from`` on are right-aligned."""
    rule = [" ---: " if numeric_from is not None and i >= numeric_from else " --- "
            for i in range(len(header))]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return lines


def _note(m: Measurement) -> str:
    if m.error:
        return m.error
    notes = []
    if m.extra.get("failed_rounds"):
        notes.append(f"{m.extra['failed_rounds']} round(s) failed")
    if m.extra.get("unfinished"):
        notes.append(f"{m.extra['unfinished']} unfinished")
    if m.extra.get("send_lag_p99_ms", 0) > 5:
        notes.append(f"client lag p99 {fmt_ms(m.extra['send_lag_p99_ms'])} ms")
    if m.extra.get("delayed_pct", 0) > 50:
        notes.append(f"client sent {m.extra['delayed_pct']:.0f}% late")
    return "; ".join(notes)


def measurement_rows(
    measurements: Sequence[Measurement],
    order: Sequence[str],
    labels: dict[str, str],
    reference: dict[tuple[str, str, str, float], Measurement],
) -> list[list[str]]:
    """Rows of peer, load, req/s, p50, p90, p99, errors, ratio to rtserve, note.

    The ratio is throughput over rtserve's in closed loop, and p99 over rtserve's in open loop
    (where every server below saturation carries the offered rate).
    """
    rows: list[list[str]] = []
    rank = {name: i for i, name in enumerate(order)}
    ordered = sorted(measurements, key=lambda m: (rank.get(m.peer, len(rank)), m.load))
    for _, group in itertools.groupby(ordered, key=lambda m: m.peer):
        peer_points = list(group)
        errors = {m.error for m in peer_points}
        if len(peer_points) > 1 and None not in errors and len(errors) == 1:
            m = peer_points[0]
            loads = f"{m.load:g}–{peer_points[-1].load:g}"
            rows.append([labels.get(m.peer, m.peer), loads, *_figures(m, None), _note(m)])
            continue
        for m in peer_points:
            ref = reference.get((m.workload, m.client, m.mode, m.load))
            share = None
            if m.ok and ref is not None and ref.ok:
                share = ratio(m.p99_ms, ref.p99_ms) if m.mode == "open" else ratio(m.rps, ref.rps)
            rows.append([labels.get(m.peer, m.peer), f"{m.load:g}", *_figures(m, share), _note(m)])
    return rows


def _figures(m: Measurement, share: float | None) -> list[str]:
    """req/s, p50, p90, p99, errors and the ratio to rtserve; dashes for a failed point."""
    if not m.ok:
        return ["—"] * 5 + [fmt_ratio(share)]
    return [fmt_rps(m.rps), fmt_ms(m.p50_ms), fmt_ms(m.p90_ms), fmt_ms(m.p99_ms), str(m.errors),
            fmt_ratio(share)]  # fmt: skip


def _rtserve_reference(
    measurements: Sequence[Measurement],
) -> dict[tuple[str, str, str, float], Measurement]:
    return {(m.workload, m.client, m.mode, m.load): m for m in measurements if m.peer == "rtserve"}


def matrix_section(record: RunRecord, workload: str) -> list[str]:
    lines: list[str] = []
    points = [m for m in record.matrix if m.workload == workload]
    reference = _rtserve_reference(points)
    clients = [c for c in CLIENT_TITLES if any(m.client == c for m in points)]
    for mode, mode_title, load_name in (
        ("closed", "closed loop", "concurrency"),
        ("open", "open loop", "offered req/s"),
    ):
        for client in clients:
            chosen = [m for m in points if m.client == client and m.mode == mode]
            if not chosen:
                continue
            lines += ["", f"#### {CLIENT_TITLES[client]}: {mode_title}", ""]
            share_name = "p99 × rtserve" if mode == "open" else "req/s × rtserve"
            header = ["peer", load_name, "req/s", "p50 ms", "p90 ms", "p99 ms", "errors",
                      share_name, "note"]  # fmt: skip
            lines += markdown_table(
                header, measurement_rows(chosen, record.order, record.labels, reference)
            )
    return lines


def limits_section(record: RunRecord, workload: str) -> list[str]:
    lines: list[str] = []
    model = [m for m in record.limits if m.workload == workload]
    if model:
        best = max((m for m in model if m.ok), key=lambda m: m.rps, default=None)
        lines += ["", "#### Limits", ""]
        if best is not None:
            lines.append(
                f"- The model alone, in-process through onnxruntime: **{fmt_rps(best.rps)} "
                f"rows/s** at batch {best.load:g} ({fmt_ms(best.p50_ms)} ms per batch, p50)."
            )
        sizes = ", ".join(f"{m.load:g}: {fmt_rps(m.rps)} rows/s" for m in model if m.ok)
        lines.append(f"- Per batch size: {sizes}.")
    bare = [m for m in record.matrix if m.workload == workload and m.peer == "bare_asgi"]
    wrk32 = next((m for m in bare if m.client == "wrk" and m.load == 32 and m.ok), None)
    if wrk32 is not None:
        lines.append(
            f"- The HTTP layer alone (bare ASGI on uvicorn, orjson parse, fixed answer): "
            f"**{fmt_rps(wrk32.rps)} req/s** with wrk at 32 connections "
            f"(p99 {fmt_ms(wrk32.p99_ms)} ms)."
        )
    return lines


@dataclass(frozen=True)
class Goal:
    name: str
    target: str
    value: str
    met: bool | None


HEADLINE_REFERENCES = ("bare_asgi", "raw_asgi", "fastapi")
BASELINE = "rtserve_baseline"


def headline_goals(points: Sequence[Measurement], rounds: Sequence[Measurement] = ()) -> list[Goal]:
    """The core serving issue's targets, from the headline comparison.

    With ``rounds`` (each round's points) a ratio is the median of the per-round ratios;
    without, the ratio of the medians in ``points``.
    """
    at = {m.peer: m for m in points if m.client == "wrk" and m.mode == "closed" and m.ok}
    rt = at.get("rtserve")
    rows = round_ratios(rounds, "rtserve", HEADLINE_REFERENCES) if rounds else []
    goals: list[Goal] = []
    for peer, target, title in (
        ("bare_asgi", 0.6, "rtserve JSON req/s vs bare ASGI (a)"),
        ("raw_asgi", 1.5, "rtserve JSON req/s vs raw ASGI 1 run/request (b)"),
        ("fastapi", 6.0, "rtserve JSON req/s vs naive FastAPI (c)"),
    ):
        other = at.get(peer)
        share = ratio(rt.rps, other.rps) if rt and other else None
        share = median_ratio(rows, peer) if rows else share
        met = None if share is None else share >= target
        goals.append(Goal(title, f">= {target:g}x", fmt_ratio(share), met))
    raw = at.get("raw_asgi")
    known = rt and raw and rt.p99_ms is not None and raw.p99_ms is not None
    shown = f"{fmt_ms(rt.p99_ms)} vs {fmt_ms(raw.p99_ms)} ms" if known else "—"  # type: ignore[union-attr]
    met = rt.p99_ms <= raw.p99_ms if known else None  # type: ignore[operator,union-attr]
    return [*goals, Goal("rtserve p99 vs raw ASGI p99 (b)", "<= (b)", shown, met)]


def headline_section(record: RunRecord) -> list[str]:
    if not record.headline:
        return []
    points = record.headline
    reference = _rtserve_reference(points)
    lines = [
        "",
        "## The core serving comparison (MLP, one row per request, 32 connections)",
        "",
        "Medians of alternating rounds (the order rotates each round; `rounds`: each round's "
        "req/s). wrk sends V2 JSON; perf_analyzer times rtserve's binary HTTP and gRPC paths.",
        "",
    ]
    rows = []
    rank = {name: i for i, name in enumerate(record.order)}
    for m in sorted(points, key=lambda m: (m.client != "wrk", rank.get(m.peer, 99), m.client)):
        ref = reference.get((m.workload, "wrk", m.mode, m.load))
        share = ratio(m.rps, ref.rps) if (m.ok and ref and ref.ok) else None
        note = _note(m)
        if m.ok and m.extra.get("rounds_rps"):
            rounds = ", ".join(fmt_rps(v) for v in m.extra["rounds_rps"])
            note = f"rounds: {rounds}" + (f"; {note}" if note else "")
        rows.append([record.labels.get(m.peer, m.peer), m.client, *_figures(m, share), note])
    header = ["server", "client", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors",
              "req/s × rtserve JSON", "note"]  # fmt: skip
    measured = {m.peer for m in record.headline_rounds}
    refs = [p for p in (*HEADLINE_REFERENCES, BASELINE) if p in measured]
    per_round = round_ratios(record.headline_rounds, "rtserve", refs)
    lines = lines[:4] + headline_summary(record, refs, per_round) + lines[4:]
    lines += markdown_table(header, rows)
    lines += round_ratio_section(record, refs, per_round)
    lines += ["", "Goals of the core serving issue:", ""]
    mark = {True: "met", False: "**not met**", None: "not measured"}
    lines += markdown_table(
        ["goal", "target", "measured", "status"],
        [[g.name, g.target, g.value, mark[g.met]]
         for g in headline_goals(points, record.headline_rounds)],
    )  # fmt: skip
    return lines


def headline_summary(
    record: RunRecord, refs: list[str], rows: list[dict[str, float | None]]
) -> list[str]:
    """The headline sentence: median per-round ratios of rtserve's JSON throughput."""
    if not rows:
        return []
    parts = [
        f"{fmt_ratio(median_ratio(rows, ref))} of {record.labels.get(ref, ref)}" for ref in refs
    ]
    lines = [
        "",
        f"**Headline (MLP, V2 JSON, wrk -c32; median of {len(rows)} per-round ratios): "
        f"rtserve reaches {'; '.join(parts)}.**",
    ]
    if record.baseline:
        lines += [
            "",
            f"Baseline: {record.labels.get(BASELINE, BASELINE)} is rtserve as of "
            f"{record.baseline}, run from a git worktree with the same venv, in the same rounds; "
            "its ratio is this tree's rtserve over it (1.00x: no change).",
        ]
    return lines


def round_ratio_section(
    record: RunRecord, refs: list[str], rows: list[dict[str, float | None]]
) -> list[str]:
    """Each round's ratios: servers of a round ran back to back, so these pair like with like."""
    if not rows:
        return []
    rt = {m.round: m for m in record.headline_rounds if m.peer == "rtserve"}
    rounds = sorted({m.round for m in record.headline_rounds})
    header = ["round", "rtserve req/s"] + [f"× {record.labels.get(r, r)}" for r in refs]
    table = []
    for round_no, row in zip(rounds, rows, strict=True):
        own = rt.get(round_no)
        rps = fmt_rps(own.rps) if own is not None and own.ok else "—"
        table.append([str(round_no + 1), rps] + [fmt_ratio(row[r]) for r in refs])
    medians = [fmt_ratio(median_ratio(rows, r)) for r in refs]
    table.append(["**median**", ""] + [f"**{m}**" for m in medians])
    return [
        "",
        "rtserve's JSON req/s over each server's, round by round (the headline is the "
        "median of these, not the ratio of the medians above):",
        "",
        *markdown_table(header, table),
    ]


SLO_DIR = Path(__file__).resolve().parent / "results" / "slo"
SLO_LINK = "../bench/results/slo"  # SLO_DIR as linked from a page under docs/


def slo_section(slo_dir: Path = SLO_DIR) -> list[str]:
    """The latency-objective benchmark's plots (``python -m bench.slo_openloop``, run on its
    own and committed under bench/results/slo/), so that this page shows them too."""
    plots = sorted(slo_dir.glob("*.png")) if slo_dir.is_dir() else []
    if not plots:
        return []
    lines = [
        "",
        "## Latency objectives: SLO controller vs fixed windows and Triton",
        "",
        "Open loop (Poisson), 0.2x to 3x of capacity; goodput = answers within the objective "
        "per second; `slo: {p99_ms: ...}` against fixed windows and Triton's batcher. Tables "
        "and commands: [benchmarks-slo.md](benchmarks-slo.md).",
        "",
    ]
    for png in plots:
        lines += [f"![{png.stem}]({SLO_LINK}/{png.name})", "", f"*{png.stem}*", ""]
    return lines


def render(record: RunRecord, title: str, details: str | None = None) -> str:
    """The report page. ``details``: where the evidence sections (each workload's tables at
    every load, the plots, the client commands, the load averages) are written instead, by
    ``render_details``; the page then links there (None: one page with everything)."""
    lines = [
        f"# {title}",
        "",
        f"Generated by `{record.command}` ({record.mode} mode) on {record.started}, "
        f"{record.duration_s / 60:.1f} minutes. Raw points: `bench/results/raw/` (not committed).",
        "",
        "Each server ran alone on 127.0.0.1, the load client on the same cores, started, warmed "
        "up, measured and stopped before the next. Differences under ~15% are run-to-run swing.",
        "",
        "Related: [benchmarks-cache.md](benchmarks-cache.md) (`python -m bench.cache_zipf`), "
        "[optimization.md](optimization.md) (`make optimize-report`), [serving.md](serving.md).",
        "",
        "## Machine",
        "",
    ]
    lines += markdown_table(["fact", "value"], list(record.machine.items()))
    lines += ["", "## Settings", ""]
    lines += markdown_table(["setting", "value"], list(record.settings.items()))
    lines += headline_section(record)
    lines += slo_section()
    if details is None:
        lines += _evidence(record)
    else:
        lines += [
            "",
            "## Every load point",
            "",
            f"Each workload's tables at every concurrency and offered load, the plots, the "
            f"client commands and the load average before each server: [{details}]({details}).",
        ]
    lines += ["", "## Versions", ""]
    lines += markdown_table(["component", "version"], list(record.versions.items()))
    if record.notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {note}" for note in record.notes]
    return "\n".join(lines).rstrip() + "\n"


def render_details(record: RunRecord, title: str) -> str:
    """The evidence behind ``render(..., details=...)``: every load point, plots, commands."""
    lines = [
        f"# {title}: every load point",
        "",
        f"Generated by `{record.command}` on "
        f"{record.started}; the summary, machine and settings are on the report page.",
    ]
    # The page lies in bench/results/, the plots in docs/img/.
    return "\n".join([*lines, *_evidence(record, "../../docs/")]).rstrip() + "\n"


def _evidence(record: RunRecord, plot_prefix: str = "") -> list[str]:
    lines: list[str] = []
    workloads = sorted({m.workload for m in record.matrix} | {m.workload for m in record.limits})
    for workload in sorted(workloads, key=lambda w: (w != "mlp", w)):
        lines += ["", f"## Workload: {workload}"]
        lines += limits_section(record, workload)
        lines += matrix_section(record, workload)
    if record.plots:
        lines += ["", "## Plots", ""]
        for caption, path in record.plots:
            lines += [f"![{caption}]({plot_prefix}{path})", "", f"*{caption}*", ""]
    if record.commands:
        lines += ["", "## Client commands (one example each)", ""]
        for client, cmd in record.commands.items():
            lines += [f"- {client}: `{cmd}`"]
    if record.loads:
        lines += ["", "## Load average before each server started", ""]
        lines += markdown_table(
            ["workload", "server", "1 / 5 / 15 min"], [list(x) for x in record.loads]
        )
    return lines
