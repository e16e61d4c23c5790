"""A version directory without model.onnx (a forgotten ``backend: python``): the load
error names the files there and what each backend expects. Real server, tritonclient."""

from __future__ import annotations

from pathlib import Path

import pytest
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from tests.conftest import start_server

CONFIG = """max_batch_size: 8
inputs: [{name: X, datatype: FP32, shape: [4]}]
outputs: [{name: Y, datatype: FP32, shape: [4]}]
"""


def test_missing_model_onnx_names_the_backends_and_the_files(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name, files in {"pycode": ["model.py", "helpers.py"], "empty": []}.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.yaml").write_text(CONFIG)  # no backend: python
        for f in files:
            (repo / name / "1" / f).write_text("class Model:\n    pass\n")
    server = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit")
    try:
        client = thttp.InferenceServerClient(server.http)
        with pytest.raises(InferenceServerException) as info:
            client.load_model("pycode")
        message = str(info.value)
        assert "pycode/1: model.onnx not found" in message
        assert "holds helpers.py, model.py" in message
        hint = message.index("backend: python (model.py)")
        assert hint < message.index("backend: torch (model.pt")  # the likely one first
        assert "backend: ensemble" in message
        with pytest.raises(InferenceServerException) as info:
            client.load_model("empty")
        assert "holds no files" in str(info.value)
        assert "backend: python (model.py)" in str(info.value)
    finally:
        server.stop()
