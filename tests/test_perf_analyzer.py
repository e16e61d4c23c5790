"""Triton's load client, perf_analyzer (from the tritonclient wheel), runs against rtserve."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import RunningServer, run_perf_analyzer


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs_without_errors(
    server: RunningServer, perf_analyzer_env: dict[str, str], protocol: str, tmp_path: Path
) -> None:
    url = server.http if protocol == "http" else server.grpc
    csv = tmp_path / "result.csv"
    args = [
        "-m", "mlp", "-u", url, "-i", protocol,
        "--concurrency-range", "4", "--input-data", "zero",
        "--measurement-mode", "count_windows", "--measurement-request-count", "300",
        "--stability-percentage", "999", "--max-trials", "3", "-f", str(csv),
    ]  # fmt: skip
    output = run_perf_analyzer(args, perf_analyzer_env)
    assert "error" not in output.lower()
    rows = csv.read_text().strip().splitlines()
    assert rows[0].startswith("Concurrency,Inferences/Second")
    assert float(rows[1].split(",")[1]) > 0


@pytest.mark.slow
def test_perf_analyzer_runs_a_model_of_one_value_a_row(
    perf_analyzer_env: dict[str, str], tmp_path: Path
) -> None:
    """x [batch] -> y [batch]: the config says dims [1] (Triton's form), so the metadata says
    [-1, 1] and requests shaped [B, 1] are taken as [B] (perf_analyzer could not shape its
    input before); [B] is still accepted."""
    import numpy as np
    import onnx
    import tritonclient.http as thttp
    from onnx import TensorProto, helper

    from tests.conftest import start_server

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "repo" / "rows" / "1").mkdir(parents=True)
    onnx.save(model, str(tmp_path / "repo" / "rows" / "1" / "model.onnx"))
    (tmp_path / "repo" / "rows" / "config.yaml").write_text("max_batch_size: 8\n")
    s = start_server(tmp_path / "repo", tmp_path / "s")
    try:
        client = thttp.InferenceServerClient(s.http)
        assert client.get_model_metadata("rows")["inputs"][0]["shape"] == [-1, 1]
        assert client.get_model_config("rows")["input"][0]["dims"] == [1]
        for shape in ([3, 1], [3]):
            inp = thttp.InferInput("x", shape, "FP32")
            inp.set_data_from_numpy(np.array([-1.0, 2.0, 3.0], np.float32).reshape(shape))
            assert client.infer("rows", [inp]).as_numpy("y").tolist() == [0.0, 2.0, 3.0]
        for protocol, url in (("http", s.http), ("grpc", s.grpc)):
            args = [
                "-m", "rows", "-u", url, "-i", protocol, "-b", "2",
                "--concurrency-range", "2", "--measurement-mode", "count_windows",
                "--measurement-request-count", "100", "--stability-percentage", "999",
                "--max-trials", "3",
            ]  # fmt: skip
            run_perf_analyzer(args, perf_analyzer_env)
    finally:
        s.stop()
