"""The container image serves the README's examples (text-embedding, image-classifier).

No container runtime runs here (the docker CLI has no daemon, and base images cannot be
pulled), so this test reproduces the image's install instead of building it: a clean venv
(no system site-packages, nothing from the dev venv) gets exactly what deploy/Dockerfile's
build stage installs, ``pip install ".[<EXTRAS>]"`` from this checkout with the Dockerfile's
default EXTRAS, then runs the Dockerfile's ENTRYPOINT (its flags, with the repository path
and loopback ports swapped in) on examples/repository. pip resolves offline here as `make
setup` does (the machine's pip config). The venv is cached in .venv-image (git-ignored),
rebuilt when pyproject.toml or the extras change; rtserve itself is reinstalled every run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from examples.build_repository import EXAMPLE_HEADER_BYTES
from tests.conftest import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
EXAMPLES = ROOT / "examples" / "repository"
VENV = ROOT / ".venv-image"
LLM_REPO = ROOT / "examples" / "llm-repository"
LLM_VENV = ROOT / ".venv-image-llm"

pytestmark = pytest.mark.slow


def dockerfile_extras() -> str:
    """The default of ``ARG EXTRAS`` in the build stage."""
    found = re.search(r"^ARG EXTRAS=(\S*)$", DOCKERFILE.read_text(), re.M)
    assert found, "deploy/Dockerfile: no ARG EXTRAS=<default>"
    return found[1]


def entrypoint() -> list[str]:
    text = DOCKERFILE.read_text().replace("\\\n", "")
    found = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    assert found, "deploy/Dockerfile: no ENTRYPOINT [...]"
    return list(json.loads(found[1]))


def llm_extras() -> str:
    """The EXTRAS of the LLM image the Dockerfile documents (``docker build ... rtserve-llm``)."""
    found = re.search(r"--build-arg EXTRAS=(\S+) -t rtserve-llm", DOCKERFILE.read_text())
    assert found, "deploy/Dockerfile: no documented LLM build (--build-arg EXTRAS=... rtserve-llm)"
    return found[1]


def image_venv(extras: str, venv: Path = VENV) -> Path:
    """A clean venv holding what the image installs (cached while its inputs are the same)."""
    spec = f".[{extras}]" if extras else "."
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + spec.encode()).hexdigest()
    stamp = venv / ".image-stamp"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if not stamp.exists() or stamp.read_text() != key:
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        subprocess.run([*pip, spec], check=True, cwd=ROOT, env=env, timeout=900)
        stamp.write_text(key)
    else:  # the dependencies are there; this checkout's rtserve replaces the cached one
        subprocess.run(
            [*pip, "--no-deps", "--force-reinstall", "."],
            check=True,
            cwd=ROOT,
            env=env,
            timeout=300,
        )
    return venv


def served_command(ports_file: Path, repo: Path = EXAMPLES) -> list[str]:
    """The ENTRYPOINT with the repository and loopback ephemeral ports swapped in."""
    swap = {"/models": str(repo), "0.0.0.0": "127.0.0.1", "8000": "0", "8001": "0"}
    return [swap.get(arg, arg) for arg in entrypoint()] + ["--ports-file", str(ports_file)]


@pytest.fixture(scope="module")
def image_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not (EXAMPLES / ".built").exists():
        pytest.skip("examples/repository is not built (make examples)")
    yield from _serve(image_venv(dockerfile_extras()), EXAMPLES, tmp_path_factory, "image")


@pytest.fixture(scope="module")
def llm_image_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The LLM image (``EXTRAS=llm``) serving examples/llm-repository."""
    if not (LLM_REPO / ".built").exists():
        pytest.skip("examples/llm-repository is not built (make examples)")
    venv = image_venv(llm_extras(), LLM_VENV)
    yield from _serve(venv, LLM_REPO, tmp_path_factory, "llm-image", timeout=300)


def _serve(
    venv: Path,
    repo: Path,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    timeout: float = 120,
) -> Iterator[str]:
    work = tmp_path_factory.mktemp(name)
    ports, log_path = work / "ports.json", work / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    with open(log_path, "wb") as log:  # cwd outside the checkout: only the venv's rtserve
        proc = subprocess.Popen(
            served_command(ports, repo), stdout=log, stderr=subprocess.STDOUT, cwd=work, env=env
        )
    try:
        deadline = time.monotonic() + timeout
        while not (ports.exists() and ports.stat().st_size):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        base = f"http://127.0.0.1:{json.loads(ports.read_text())['http_port']}"
        yield base
        assert "Traceback" not in log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_image_install_is_the_dockerfile_default() -> None:
    assert dockerfile_extras() == "pipelines,trees"
    assert entrypoint()[:4] == ["rtserve", "serve", "--model-repository", "/models"]


def test_the_image_is_ready_with_every_example_model(image_server: str) -> None:
    """Strict readiness: 200 only once every model in the repository serves."""
    assert httpx.get(f"{image_server}/v2/health/ready").json() == {"ready": True}
    index = httpx.post(f"{image_server}/v2/repository/index", json={}).json()
    assert {"text-embedding", "image-classifier"} <= {m["name"] for m in index}
    assert [m for m in index if m["state"] != "READY"] == []


def test_the_image_serves_the_readme_examples(image_server: str) -> None:
    """The README's two requests, as its curl lines send them."""
    text = (EXAMPLES / "text-embedding" / "example_request.json").read_bytes()
    r = httpx.post(f"{image_server}/v2/models/text-embedding/infer", content=text)
    assert r.status_code == 200, r.text
    (embedding,) = r.json()["outputs"]
    assert embedding["name"] == "EMBEDDING" and embedding["shape"][1] == 384

    image = (EXAMPLES / "image-classifier" / "example_request.bin").read_bytes()
    r = httpx.post(
        f"{image_server}/v2/models/image-classifier/infer",
        content=image,
        headers={"Inference-Header-Content-Length": str(EXAMPLE_HEADER_BYTES)},
    )
    assert r.status_code == 200, r.text
    labels = next(o for o in r.json()["outputs"] if o["name"] == "LABELS")["data"]
    assert any("cat" in label for label in labels[:3]), labels


def test_the_llm_image_uses_the_cpu_torch_index() -> None:
    """PyPI's Linux torch is the CUDA build (gigabytes of nvidia wheels): the Dockerfile
    takes torch from TORCH_INDEX (the CPU index) for the llm extra as for torch."""
    text = DOCKERFILE.read_text()
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert "*,llm,*)" in text.split("pip install")[0]
    assert "llm" in llm_extras().split(",")


def test_the_llm_image_serves_the_example_chat(llm_image_server: str) -> None:
    """Ready with the SmolLM2 example, and its chat answered greedily in seconds."""
    assert httpx.get(f"{llm_image_server}/v2/health/ready").json() == {"ready": True}
    start = time.monotonic()
    r = httpx.post(
        f"{llm_image_server}/v1/chat/completions",
        json={
            "model": "smollm2",
            "temperature": 0,
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert time.monotonic() - start < 20
