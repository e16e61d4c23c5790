"""A plain install that lacks an extra's packages: the model fails to load with an error
that names the extra to install, not a bare ModuleNotFoundError.

The server runs in a real subprocess where the packages are made unimportable (their
``sys.modules`` entries set to None, as an environment without them behaves for import)."""

from __future__ import annotations

import sys

import httpx
import pytest

from rtserve.extras import install_hint
from tests.conftest import RELAXED, start_server
from tests.llm_models import build_llm
from tests.models import write_python_model

LAUNCHER = """\
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # import name -> ModuleNotFoundError, as if not installed
sys.argv = ["rtserve", *sys.argv[5:]]  # (after: python -m rtserve.cli)
runpy.run_module("rtserve.cli", run_name="__main__")
"""
PY_CONFIG = {
    "backend": "python",
    "max_batch_size": 0,
    "inputs": [{"name": "X", "datatype": "FP32", "shape": [1]}],
    "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}],
}


def test_install_hint_names_the_extra() -> None:
    def missing(name: str) -> ModuleNotFoundError:
        return ModuleNotFoundError(f"No module named '{name}'", name=name)

    assert install_hint(missing("torch"), "llm").endswith("pip install 'rtserve[llm]'")
    assert install_hint(missing("torch"), "torch").endswith("pip install 'rtserve[torch]'")
    assert install_hint(missing("PIL.Image")).endswith("pip install 'rtserve[pipelines]'")
    assert install_hint(missing("tokenizers")).endswith("pip install 'rtserve[pipelines]'")
    assert "'cv2'" in install_hint(missing("cv2"))
    wrapped = RuntimeError("load failed")
    wrapped.__cause__ = missing("transformers")
    assert install_hint(wrapped).endswith("'rtserve[llm]'")
    assert install_hint(ValueError("x")) == ""


@pytest.fixture(scope="module")
def reasons(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("missing-extras")
    repo = root / "repo"
    build_llm(repo, "tiny-llm")
    model = "class Model:\n    def infer(self, inputs):\n        return {'Y': inputs['X']}\n"
    write_python_model(repo, "decode", PY_CONFIG, "import PIL.Image\n" + model)
    write_python_model(repo, "tokenize", PY_CONFIG, "import tokenizers\n" + model)
    launcher = root / "launch.py"
    launcher.write_text(LAUNCHER)
    blocked = "torch,transformers,PIL,tokenizers"
    prefix = (sys.executable, str(launcher), blocked)
    server = start_server(repo, root / "server", *RELAXED, prefix=prefix, timeout=120)
    try:
        index = httpx.post(f"{server.base}/v2/repository/index", json={}).json()
    finally:
        server.stop()
    return {m["name"]: m.get("reason", "") for m in index}


@pytest.mark.parametrize(
    ("model", "module", "extra"),
    [
        ("tiny-llm", "torch", "llm"),
        ("decode", "PIL", "pipelines"),
        ("tokenize", "tokenizers", "pipelines"),
    ],
)
def test_a_model_whose_extra_is_missing_names_it(
    reasons: dict[str, str], model: str, module: str, extra: str
) -> None:
    reason = reasons[model]
    assert f"this install lacks '{module}'" in reason, reason
    assert f"pip install 'rtserve[{extra}]'" in reason, reason
