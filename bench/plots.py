"""PNG plots: throughput against p99 (closed loop) and p99 against offered load (open loop)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

from bench.results import Measurement  # noqa: E402


def _series(
    points: Sequence[Measurement], order: Sequence[str]
) -> list[tuple[str, list[Measurement]]]:
    by_peer: dict[str, list[Measurement]] = {}
    for m in points:
        if m.ok and m.p99_ms is not None:
            by_peer.setdefault(m.peer, []).append(m)
    rank = {name: i for i, name in enumerate(order)}
    return [
        (peer, sorted(items, key=lambda m: m.load))
        for peer, items in sorted(by_peer.items(), key=lambda kv: rank.get(kv[0], 99))
    ]


def _style(peer: str) -> dict[str, object]:
    if peer == "rtserve":
        return {"linewidth": 2.6, "color": "black", "marker": "o", "zorder": 5}
    if peer in ("bare_asgi", "raw_asgi"):
        return {"linestyle": "--", "marker": "."}
    return {"marker": "o", "markersize": 4}


def save(fig: Any, out: Path, dpi: int | None = None) -> Path:
    """Lay out, write (its folder made) and close a figure."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi or "figure")
    plt.close(fig)
    return out


_KINDS: dict[str, tuple[Callable[[Measurement], float], str, str]] = {
    "closed": (
        lambda m: m.rps,
        "throughput, req/s (log)",
        "each point one concurrency: 1, 8, 32, 64; down-right is better",
    ),
    "open": (
        lambda m: m.load,
        "offered load, req/s (Poisson arrivals, log)",
        "a line that stops: the next rate was past saturation",
    ),
}


def draw(
    kind: str,
    points: Sequence[Measurement],
    order: Sequence[str],
    labels: dict[str, str],
    title: str,
    out: Path,
) -> Path:
    """``closed``: throughput against p99 per peer; ``open``: p99 against offered load."""
    x_of, x_label, hint = _KINDS[kind]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for peer, items in _series(points, order):
        ax.plot(
            [x_of(m) for m in items],
            [m.p99_ms for m in items],
            label=labels.get(peer, peer),
            **_style(peer),
        )  # type: ignore[arg-type]
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _pos: f"{value:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
        axis.set_minor_formatter(plain)
    ax.tick_params(which="minor", labelsize=7)
    ax.set(xlabel=x_label, ylabel="p99 latency, ms (log)", title=f"{title}\n({hint})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return save(fig, out)
