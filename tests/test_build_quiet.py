"""examples/build_repository.py silences the exporter's and quantizer's warnings about their
own internals (a user cannot act on them), and only those."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """\
import logging, warnings
import torch
from examples.build_repository import quiet_known_warnings
quiet_known_warnings()
warnings.warn("Converting a tensor to a Python boolean might cause the trace to be incorrect. "
              "We can't record the data flow", torch.jit.TracerWarning)
warnings.warn("Exporting aten::index operator of advanced indexing in opset 17 is achieved by "
              "combination of multiple ONNX operators", UserWarning)
warnings.warn("Constant folding - Only steps=1 can be constant folded for opset >= 10 "
              "onnx::Slice op. Constant folding not applied.", UserWarning)
logging.warning("Please consider to run pre-processing before quantization. Refer to example")
warnings.warn("a warning of the user's own model", UserWarning)
logging.warning("another root warning")
"""


def test_only_the_known_build_warnings_are_silenced() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    err = done.stderr
    for quiet in ("Python boolean", "aten::index", "Constant folding", "pre-processing"):
        assert quiet not in err, err
    assert "a warning of the user's own model" in err and "another root warning" in err, err
