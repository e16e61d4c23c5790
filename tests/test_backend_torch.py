"""The torch backend: the runtime alone (CPU; CUDA when a GPU is present), then served end
to end with Triton's clients. Results must equal eager PyTorch within the dtype's tolerance."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from rtserve.errors import ConfigError
from rtserve.runtime.torch import load
from tests.conftest import ROOT, RunningServer, start_server
from tests.models import config_of, edit_config

try:
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp
except ImportError:  # a GPU machine without the clients still runs the runtime tests
    tgrpc = thttp = None

CUDA = torch.cuda.is_available()

# The factory module a user would put beside the weights.
NET_PY = '''
import torch


class Net(torch.nn.Module):
    """Two inputs (features, token ids), two outputs (scores, argmax)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.fc1 = torch.nn.Linear(8 + 8, hidden)
        self.fc2 = torch.nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor):
        h = torch.cat([x, self.embed(ids).mean(dim=1)], dim=1)
        scores = self.fc2(torch.relu(self.fc1(h)))
        return scores, scores.argmax(dim=1)


def build(hidden: int = 16) -> Net:
    return Net(hidden)
'''

SIGNATURE = {
    "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [8]},
        {"name": "ids", "datatype": "INT64", "shape": [5]},
    ],
    "outputs": [
        {"name": "scores", "datatype": "FP32", "shape": [3]},
        {"name": "best", "datatype": "INT64", "shape": []},
    ],
}


def net_module(directory: Path) -> Any:
    namespace: dict[str, Any] = {}
    exec(compile(NET_PY, str(directory / "net.py"), "exec"), namespace)
    return namespace


def make_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    net: torch.nn.Module = net_module(Path("."))["build"](hidden=16)
    return net.eval()


def example(rows: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, 8)).astype(np.float32),
        "ids": rng.integers(0, 50, size=(rows, 5)).astype(np.int64),
    }


def eager(net: torch.nn.Module, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        scores, best = net(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["ids"]))
    return {"scores": scores.numpy(), "best": best.numpy()}


def write_model(root: Path, name: str, form: str, net: torch.nn.Module, **torch_opts: Any) -> Path:
    """A model directory holding ``net`` as a factory + weights, TorchScript or export."""
    version = root / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    opts: dict[str, Any] = dict(torch_opts)
    if form == "factory":
        (version / "net.py").write_text(NET_PY)
        torch.save(net.state_dict(), version / "weights.pt")
        opts.update(factory="net:build", factory_args={"hidden": 16}, weights="weights.pt")
    elif form == "torchscript":
        ex = example(2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript is deprecated, still deployed
            traced = torch.jit.trace(net, (torch.from_numpy(ex["x"]), torch.from_numpy(ex["ids"])))
        traced.save(str(version / "model.pt"))
    else:
        ex = example(2)
        batch = torch.export.Dim("batch", min=1, max=1024)
        program = torch.export.export(
            net,
            (torch.from_numpy(ex["x"]), torch.from_numpy(ex["ids"])),
            dynamic_shapes=({0: batch}, {0: batch}),
        )
        torch.export.save(program, str(version / "model.pt2"))
    config = {"backend": "torch", "max_batch_size": 8, **SIGNATURE, "torch": opts}
    (root / name / "config.yaml").write_text(yaml.safe_dump(config))
    return root / name


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], tol: float) -> None:
    assert got["scores"].dtype == np.float32 and got["best"].dtype == np.int64
    np.testing.assert_allclose(got["scores"], want["scores"], rtol=tol, atol=tol)
    if tol < 1e-4:
        np.testing.assert_array_equal(got["best"], want["best"])


# ---------------------------------------------------------------------- the runtime alone
@pytest.mark.parametrize("form", ["factory", "torchscript", "export"])
def test_each_model_form_matches_eager(tmp_path: Path, form: str) -> None:
    net = make_net()
    model_dir = write_model(tmp_path, "net", form, net, device="cpu")
    rt = load(config_of(model_dir), model_dir / "1")
    try:
        assert rt.kind == form and rt.max_batch_size == 8 and rt.device.type == "cpu"
        for rows in (1, 3, 8):
            feeds = example(rows, seed=rows)
            assert_close(rt.run(0, feeds), eager(net, feeds), 1e-5)
    finally:
        rt.close()


def test_batch_buckets_pad_and_slice_back(tmp_path: Path) -> None:
    net = make_net(3)
    model_dir = write_model(tmp_path, "net", "factory", net, device="cpu", batch_buckets=[4, 1, 2])
    edit_config(model_dir, {"max_batch_size": None})
    rt = load(config_of(model_dir), model_dir / "1")
    try:
        assert rt.max_batch_size == 4  # unset: the largest bucket
        for rows in (1, 2, 3, 4):
            feeds = example(rows, seed=10 + rows)
            got = rt.run(0, feeds)
            assert got["scores"].shape == (rows, 3) and got["best"].shape == (rows,)
            assert_close(got, eager(net, feeds), 1e-5)
    finally:
        rt.close()


@pytest.mark.parametrize(("dtype", "tol"), [("bfloat16", 5e-2), ("float16", 1e-2)])
def test_reduced_precision_returns_declared_datatypes(
    tmp_path: Path, dtype: str, tol: float
) -> None:
    net = make_net(5)
    model_dir = write_model(tmp_path, "net", "factory", net, device="cpu", dtype=dtype)
    rt = load(config_of(model_dir), model_dir / "1")
    try:
        feeds = example(6, seed=4)
        assert_close(rt.run(0, feeds), eager(net, feeds), tol)
    finally:
        rt.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"inputs": None}, r"config.yaml: inputs: required for backend torch"),
        ({"torch": {"device": "gpu"}}, r"torch.device: expected auto, cpu, cuda or cuda:N"),
        ({"torch": {"dtype": "int8"}}, r"torch.dtype: expected one of float32, float16"),
        ({"torch": {"compile": "fast"}}, r"torch.compile: expected one of none, default"),
        ({"torch": {"factory": "net"}}, r'torch.factory: expected "module:function"'),
        ({"torch": {"factory": "net:nope"}}, r"no function 'nope'"),
        ({"torch": {"batch_buckets": [2, 4]}}, r"largest bucket \(4\) must be >= max_batch_size"),
        ({"torch": {"weights": "w.pt"}}, r"torch.weights: expected weights only together"),
        ({"torch": {"compile": "default"}}, r"torch.compile: default needs an eager module"),
        ({"torch": {"warp": 9}}, r"torch.warp: unknown field"),
        ({"torch": {"file": "missing.pt"}}, r"no missing.pt found"),
    ],
)
def test_config_errors_name_file_and_field(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    model_dir = write_model(tmp_path, "net", "torchscript", make_net())
    (model_dir / "1" / "net.py").write_text(NET_PY)
    edit_config(model_dir, change)
    with pytest.raises(ConfigError, match=message):
        load(config_of(model_dir), model_dir / "1")


def test_bytes_tensors_are_refused_at_load(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "net", "torchscript", make_net())
    data = yaml.safe_load((model_dir / "config.yaml").read_text())
    data["outputs"][1]["datatype"] = "BYTES"
    (model_dir / "config.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"outputs\[1\].datatype: backend torch supports"):
        load(config_of(model_dir), model_dir / "1")


def test_torch_is_imported_only_by_the_torch_backend() -> None:
    code = (
        "import sys, rtserve.cli, rtserve.core.model, rtserve.runtime.base, "
        "rtserve.runtime.python, rtserve.runtime.onnx, rtserve.server.app\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


# ---------------------------------------------------------------------- CUDA (GPU machines)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_mode", ["none", "reduce-overhead"])
def test_cuda_fp16_buckets_match_eager(tmp_path: Path, compile_mode: str) -> None:
    net = make_net(7)
    model_dir = write_model(
        tmp_path, "net", "factory", net,
        device="cuda", dtype="float16", compile=compile_mode, batch_buckets=[1, 2, 4, 8],
    )  # fmt: skip
    rt = load(config_of(model_dir), model_dir / "1")
    try:
        assert rt.device.type == "cuda"
        for rows in (1, 3, 8, 5, 2):
            feeds = example(rows, seed=20 + rows)
            assert_close(rt.run(0, feeds), eager(net, feeds), 2e-2)
    finally:
        rt.close()


# ---------------------------------------------------------------------- served end to end
@pytest.fixture(scope="module")
def torch_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RunningServer, torch.nn.Module]]:
    if thttp is None:
        pytest.skip("tritonclient is not installed")
    repo = tmp_path_factory.mktemp("torchrepo")
    net = make_net(11)
    write_model(repo, "net", "factory", net, batch_buckets=[1, 2, 4, 8])
    write_model(repo, "net_script", "torchscript", net, device="cpu")
    server = start_server(repo, tmp_path_factory.mktemp("torchserver"))
    yield server, net
    server.stop()


@pytest.mark.parametrize("model", ["net", "net_script"])
def test_served_results_equal_eager_pytorch(
    torch_server: tuple[RunningServer, torch.nn.Module], model: str
) -> None:
    server, net = torch_server
    feeds = example(3, seed=30)
    want = eager(net, feeds)
    tol = 2e-2 if CUDA else 1e-5
    hclient = thttp.InferenceServerClient(server.http)
    hinputs = []
    for name, datatype in (("x", "FP32"), ("ids", "INT64")):
        hi = thttp.InferInput(name, list(feeds[name].shape), datatype)
        hi.set_data_from_numpy(feeds[name], binary_data=name == "x")
        hinputs.append(hi)
    result = hclient.infer(model, hinputs)
    assert_close({n: result.as_numpy(n) for n in ("scores", "best")}, want, tol)
    gclient = tgrpc.InferenceServerClient(server.grpc)
    ginputs = []
    for name, datatype in (("x", "FP32"), ("ids", "INT64")):
        gi = tgrpc.InferInput(name, list(feeds[name].shape), datatype)
        gi.set_data_from_numpy(feeds[name])
        ginputs.append(gi)
    gresult = gclient.infer(model, ginputs)
    assert_close({n: gresult.as_numpy(n) for n in ("scores", "best")}, want, tol)
    meta = hclient.get_model_metadata(model)
    assert meta["platform"] == "pytorch_libtorch"
    assert [i["name"] for i in meta["inputs"]] == ["x", "ids"]


def test_served_wrong_input_is_a_4xx_and_the_server_keeps_serving(
    torch_server: tuple[RunningServer, torch.nn.Module],
) -> None:
    from tritonclient.utils import InferenceServerException

    server, _ = torch_server
    client = thttp.InferenceServerClient(server.http)
    bad = thttp.InferInput("x", [2, 7], "FP32")
    bad.set_data_from_numpy(np.zeros((2, 7), np.float32))
    ids = thttp.InferInput("ids", [2, 5], "INT64")
    ids.set_data_from_numpy(np.zeros((2, 5), np.int64))
    with pytest.raises(InferenceServerException) as info:
        client.infer("net", [bad, ids])
    assert info.value.status() == "400" and "x" in str(info.value)
    good = thttp.InferInput("x", [2, 8], "FP32")
    good.set_data_from_numpy(np.zeros((2, 8), np.float32))
    assert client.infer("net", [good, ids]).as_numpy("scores").shape == (2, 3)
    # a token id past the embedding table: the client's 400, no TorchScript traceback
    big = thttp.InferInput("ids", [2, 5], "INT64")
    big.set_data_from_numpy(np.full((2, 5), 99, np.int64))
    for model in ("net", "net_script"):
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, [good, big])
        message = info.value.message()
        assert info.value.status() == "400", message
        assert "refused the input" in message and "index out of range" in message
        assert "Traceback" not in message and ".py" not in message, message
        assert client.infer(model, [good, ids]).as_numpy("scores").shape == (2, 3)


def test_instances_share_weights_and_answer_alike(tmp_path: Path) -> None:
    net = make_net(9)
    model_dir = write_model(tmp_path, "net", "export", net, device="cpu")
    edit_config(model_dir, {"instance_count": 2})
    rt = load(config_of(model_dir), model_dir / "1")
    try:
        assert rt.instance_count == 2
        feeds = example(4, seed=9)
        want = eager(net, feeds)
        assert_close(rt.run(0, feeds), want, 1e-5)
        assert_close(rt.run(1, feeds), want, 1e-5)
    finally:
        rt.close()
