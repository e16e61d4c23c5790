"""Every code block of docs/python-api.md and docs/generative.md, extracted and run.

Python blocks run as scripts in a subprocess from the repository root (the in-process
``Engine`` over the example repositories, as they are written; a block that talks to
127.0.0.1:8000 runs against a live server of the example LLM repository). Shell blocks run
in bash against that server; their ``make run*`` line is the server this test starts. YAML
blocks are model configs: they are checked as the server checks a config.yaml. A block
marked ``<!-- snippet: skip REASON -->`` (GPU, Docker...) is skipped with its reason.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import yaml

from tests.conftest import ROOT, RunningServer, start_server
from tests.snippets import Block, code_blocks, free, on_port

DOCS = [ROOT / "docs" / "python-api.md", ROOT / "docs" / "generative.md"]
LLM_REPO = ROOT / "examples" / "llm-repository"
BLOCKS = [b for doc in DOCS for b in code_blocks(doc)]
# What a block's output must hold (by a line of its text), beyond a zero exit status.
EXPECTED = {
    'engine.infer("mlp"': "(4, 10)",
    'engine.infer("digits"': "[",
    "What is the capital of France?": "Paris",
    "Once upon a time": "",
}


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    if not (LLM_REPO / ".built").exists():
        pytest.fail("examples/llm-repository is not built: run `make examples` first")
    ports = ("--http-port", "8000", "--grpc-port", "8001") if free(8000) and free(8001) else ()
    server = start_server(LLM_REPO, tmp_path_factory.mktemp("docs-llm-server"), *ports, timeout=300)
    yield server
    server.stop()


def _expected(block: Block) -> list[str]:
    return [out for key, out in EXPECTED.items() if key in block.text]


def _check(block: Block, done: subprocess.CompletedProcess[str], seconds: float) -> None:
    assert done.returncode == 0, (block.id, done.stdout[-2000:], done.stderr[-3000:])
    for expected in _expected(block):
        assert expected in done.stdout, (block.id, expected, done.stdout[-2000:])
    # (an Engine loading the example repository: ~10 s alone, minutes on shared cores)
    assert seconds < 280, f"{block.id}: {seconds:.0f} s"


def test_the_docs_have_the_blocks_this_test_runs() -> None:
    langs = [b.lang for b in BLOCKS]
    assert langs.count("python") >= 4 and "bash" in langs and "yaml" in langs, langs
    for block in BLOCKS:
        assert block.lang in ("python", "bash", "yaml"), f"{block.id}: no runner for this block"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_runs_as_a_script(block: Block, request: pytest.FixtureRequest) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    assert _expected(block), f"{block.id}: add what its output must hold to EXPECTED"
    text = block.text
    if "127.0.0.1:8000" in text or "localhost:8000" in text:
        server: RunningServer = request.getfixturevalue("llm_server")
        text = on_port(text, server.http_port, server.grpc_port)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", text], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    _check(block, done, time.monotonic() - start)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash"], ids=lambda b: b.id)
def test_shell_block_runs_against_a_live_server(block: Block, llm_server: RunningServer) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    lines = [ln for ln in block.text.splitlines() if not ln.startswith("make run")]
    script = on_port("\n".join(lines), llm_server.http_port, llm_server.grpc_port)
    start = time.monotonic()
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    seconds = time.monotonic() - start
    _check(block, done, seconds)
    if "/v1/chat/completions" in script:
        assert seconds < 60, f"{block.id}: the chat took {seconds:.1f} s"
        assert done.stdout.rstrip().endswith("data: [DONE]"), done.stdout[-300:]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "yaml"], ids=lambda b: b.id)
def test_yaml_block_is_a_valid_model_config(block: Block) -> None:
    """The documented config is one the server accepts, field for field."""
    if block.skip is not None:
        pytest.skip(block.skip)
    from rtserve.config import parse_model_config

    doc = yaml.safe_load(block.text)
    config = parse_model_config(doc, "model", "config.yaml")
    if doc.get("backend") == "llm":
        from rtserve.runtime.llm.options import LlmOptions

        options = LlmOptions.parse({**doc["llm"], "slo": doc.get("slo")}, "config.yaml")
        for key, value in doc["llm"].items():
            got = getattr(options, key)
            assert got == value or (isinstance(got, tuple) and not value), (key, got, value)
    assert config is not None
