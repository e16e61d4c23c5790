"""A second rtserve from another commit, for before/after comparisons in one run.

``python -m bench.run --quick --baseline-ref main~3`` checks the commit out with
``git worktree`` under ``bench/.work/baseline/<sha>`` (no other checkout is touched) and
serves it with the same venv, with ``PYTHONPATH=<worktree>/src`` ahead of the editable
install; the headline then alternates it with this tree's rtserve.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.workloads import ROOT, WORK


@dataclass(frozen=True)
class Baseline:
    ref: str  # as given on the command line
    sha: str
    subject: str  # the commit's first line
    src: Path  # <worktree>/src

    @property
    def label(self) -> str:
        return f"{self.ref} ({self.sha[:10]})"


def _git(*args: str, cwd: Path = ROOT) -> str:
    proc = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip()


def resolve(ref: str) -> tuple[str, str]:
    """The full commit id and subject of ``ref``; RuntimeError naming the ref if unknown."""
    try:
        sha = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except RuntimeError:
        raise RuntimeError(f"--baseline-ref {ref!r} is not a commit of this repository") from None
    return sha, _git("log", "-1", "--format=%s", sha)


@contextlib.contextmanager
def checkout(ref: str, root: Path = WORK / "baseline") -> Iterator[Baseline]:
    """A detached worktree of ``ref`` for the duration of the block, removed afterwards."""
    sha, subject = resolve(ref)
    folder = root / sha[:12]
    if folder.exists():  # left by an interrupted run
        with contextlib.suppress(RuntimeError):
            _git("worktree", "remove", "--force", str(folder))
        shutil.rmtree(folder, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    _git("worktree", "add", "--detach", str(folder), sha)
    try:
        src = folder / "src"
        if not (src / "rtserve" / "cli.py").is_file():
            raise RuntimeError(f"--baseline-ref {ref!r}: {sha[:10]} has no src/rtserve/cli.py")
        yield Baseline(ref, sha, subject, src)
    finally:
        with contextlib.suppress(RuntimeError):
            _git("worktree", "remove", "--force", str(folder))
        shutil.rmtree(folder, ignore_errors=True)
