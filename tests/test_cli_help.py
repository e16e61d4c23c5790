"""``rtserve --help`` and every subcommand's help read as plain text (no RST markup)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rtserve.cli import build_parser
from tests.conftest import ROOT

COMMANDS = ["serve", "cold-start", "export", "optimize", "early-exit", "export-edge"]
MARKUP = re.compile(r"``|:(func|class|meth|mod):`")


def test_top_level_help_is_plain_text() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rtserve.cli", "--help"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not MARKUP.search(done.stdout), done.stdout
    assert "Start with: rtserve serve" in done.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_subcommand_help_is_plain_text(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rtserve " + command), out[:200]
    assert not MARKUP.search(out), MARKUP.search(out)
