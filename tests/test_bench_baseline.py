"""The --baseline-ref worktree and the baseline rtserve peer."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from bench import baseline, servers
from bench.workloads import MLP


def test_unknown_ref_is_named() -> None:
    with pytest.raises(RuntimeError, match="'no-such-ref-xyz' is not a commit"):
        baseline.resolve("no-such-ref-xyz")


def test_checkout_gives_that_commits_source_and_removes_it_afterwards(
    tmp_path: pathlib.Path,
) -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True, cwd=baseline.ROOT).stdout.strip()  # fmt: skip
    with baseline.checkout("HEAD", root=tmp_path) as base:
        assert base.sha == head
        assert (base.src / "rtserve" / "cli.py").is_file()
        assert base.label.startswith("HEAD (") and head[:10] in base.label
        listed = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True,
                                cwd=baseline.ROOT).stdout  # fmt: skip
        assert str(base.src.parent) in listed
        peer = servers.baseline_peer(base.label, base.src)
        cfg = servers.peer_settings(MLP, tmp_path)
        env = servers.environment(peer, cfg, tmp_path)
        assert env["PYTHONPATH"].split(os.pathsep)[1] == str(base.src)
        argv = servers.command(peer, cfg, tmp_path / "work")
        assert argv[1:4] == ["-m", "rtserve.cli", "serve"]
    assert not base.src.parent.exists()
    listed = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True,
                            cwd=baseline.ROOT).stdout  # fmt: skip
    assert str(base.src.parent) not in listed


def test_this_trees_rtserve_runs_from_this_checkout(tmp_path: pathlib.Path) -> None:
    cfg = servers.peer_settings(MLP, tmp_path)
    env = servers.environment(servers.PEERS["rtserve"], cfg, tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep)[1] == str(baseline.ROOT / "src")
