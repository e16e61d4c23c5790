"""One measured point, as every client reports it and every report reads it; a suite's
parser, command line, JSON record and page section."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson


@dataclass
class Measurement:
    """A single load point against one peer.

    ``load`` is the concurrency (closed loop) or the offered request rate (open loop);
    latencies are milliseconds; ``error`` holds a short reason when the point failed.
    """

    peer: str
    workload: str
    client: str
    mode: str
    load: float
    rps: float = 0.0
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    errors: int = 0
    requests: int = 0
    error: str | None = None
    round: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        return cls(**data)

    @classmethod
    def failed(
        cls, peer: str, workload: str, client: str, mode: str, load: float, error: str
    ) -> Measurement:
        return cls(peer, workload, client, mode, load, error=short_error(error))


def short_error(text: str, limit: int = 160) -> str:
    """One line, at most ``limit`` characters: what a table cell can hold."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def save(path: Path, measurements: list[Measurement]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(m.to_json() + "\n" for m in measurements))


def load(path: Path) -> list[Measurement]:
    return [Measurement.from_dict(data) for data in read_jsonl(path)]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One dict per non-blank line of a JSON-lines file (none when it is missing)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


MARK = "<!-- bench {} -->"
END = "<!-- /bench {} -->"


def write_section(doc: Path, key: str, text: str) -> None:
    """Replace the text between the page's markers for ``key`` (appended when absent): a
    suite rewrites its own section of a results page and keeps the rest."""
    page = doc.read_text() if doc.exists() else ""
    start, end = MARK.format(key), END.format(key)
    block = f"{start}\n{text.strip()}\n{end}"
    if start in page and end in page:
        head, rest = page.split(start, 1)
        page = head + block + rest.split(end, 1)[1]
    else:
        page = page.rstrip("\n") + f"\n\n{block}\n"
    doc.write_text(page)


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON indented by two spaces with a final newline; the folder is made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A suite's argument parser: ``doc`` (its module's docstring) as the help text."""
    return argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def command_line(prog: str, argv: Sequence[str] | None) -> str:
    """The command a report names: ``prog`` and the arguments (sys.argv's when None)."""
    return " ".join([prog, *(sys.argv[1:] if argv is None else argv)])
