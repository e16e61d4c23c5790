"""Code blocks of the docs, extracted as written, for the tests that run them.

A block preceded by ``<!-- snippet: skip REASON -->`` (an HTML comment, invisible on the
rendered page) is one that cannot run here (a GPU, Docker, a cluster): the tests skip it
and show REASON. ``<!-- snippet: port -->`` marks no skip; every other block runs.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*snippet:\s*skip\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    skip: str | None = None  # the marker's reason (None: the block runs)

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}:{self.lang or 'text'}"


def code_blocks(path: Path, end_heading: str | None = None) -> list[Block]:
    """The fenced blocks of ``path`` in order (up to the first line equal to
    ``end_heading``, when given), each with its skip marker's reason."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if end_heading is not None and lines[i].strip() == end_heading:
            break
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker = MARKER.match(lines[j].strip()) if j >= 0 else None
        skip = (marker.group(1) or "marked skip") if marker else None
        blocks.append(Block(path, start + 1, m.group(1), "\n".join(body) + "\n", skip))
        i += 1
    return blocks


def shell_commands(text: str) -> list[str]:
    """The commands of a shell block, one per line (``\\`` continuations joined), comments
    and blank lines left out."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = pending + raw
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    return out


def free(port: int) -> bool:
    """Whether ``port`` on 127.0.0.1 can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def on_port(text: str, http_port: int, grpc_port: int) -> str:
    """``text`` with the docs' default ports (8000 HTTP, 8001 gRPC) moved to the server's."""
    if (http_port, grpc_port) == (8000, 8001):
        return text
    text = re.sub(r"(localhost|127\.0\.0\.1):8000\b", rf"\g<1>:{http_port}", text)
    return re.sub(r"(localhost|127\.0\.0\.1):8001\b", rf"\g<1>:{grpc_port}", text)
