"""Data that a model refuses at run time (an embedding index out of range): a 400 /
INVALID_ARGUMENT for that request alone, with the runtime's reason; the requests batched
with it are answered as if it had not been there."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper

from tests.conftest import RunningServer, post_json, start_server

VOCAB, DIM, TOKENS = 100, 4, 5
TABLE = np.arange(VOCAB * DIM, dtype=np.float32).reshape(VOCAB, DIM)


def embedding_model(path: Path) -> None:
    """``emb[b, t] = TABLE[ids[b, t]]``: ONNX Runtime's Gather checks every index."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["emb"])],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", TOKENS])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["batch", TOKENS, DIM])],
        [onnx.numpy_helper.from_array(TABLE, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("refusals-repo")
    (repo / "emb" / "1").mkdir(parents=True)
    embedding_model(repo / "emb" / "1" / "model.onnx")
    config = {
        "backend": "onnxruntime",
        "max_batch_size": 16,
        # a long window: requests sent together share a batch
        "dynamic_batching": {"max_queue_delay_us": 300_000, "adaptive_delay": False},
    }
    (repo / "emb" / "config.yaml").write_text(yaml.safe_dump(config))
    running = start_server(repo, tmp_path_factory.mktemp("refusals-server"))
    yield running
    running.stop()


def post(server: RunningServer, ids: list[int]) -> tuple[int, Any]:
    body = {"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1, TOKENS], "data": ids}]}
    return post_json(f"{server.base}/v2/models/emb/infer", body)


def test_an_index_out_of_range_fails_only_its_own_request(server: RunningServer) -> None:
    rows = [[i, i + 1, i + 2, i + 3, i + 4] for i in range(0, 60, 10)]
    rows[2] = [1, 2, 1000, 3, 4]
    with ThreadPoolExecutor(len(rows)) as pool:
        answers = list(pool.map(lambda ids: post(server, ids), rows))
    for ids, (status, answer) in zip(rows, answers, strict=True):
        if 1000 in ids:
            assert status == 400, answer
            assert "ONNX Runtime refused the input" in answer["error"]
            assert "out of data bounds" in answer["error"]
        else:
            assert status == 200, answer
            got = np.asarray(answer["outputs"][0]["data"], np.float32).reshape(TOKENS, DIM)
            np.testing.assert_array_equal(got, TABLE[ids])


def test_grpc_gets_invalid_argument_and_the_server_keeps_serving(server: RunningServer) -> None:
    import tritonclient.grpc as tgrpc
    from tritonclient.utils import InferenceServerException

    client = tgrpc.InferenceServerClient(server.grpc)
    bad = tgrpc.InferInput("ids", [1, TOKENS], "INT64")
    bad.set_data_from_numpy(np.array([[0, 1, 2, 3, -500]], np.int64))
    with pytest.raises(InferenceServerException) as info:
        client.infer("emb", [bad])
    assert "INVALID_ARGUMENT" in str(info.value.status())
    assert "out of data bounds" in str(info.value)
    good = tgrpc.InferInput("ids", [1, TOKENS], "INT64")
    good.set_data_from_numpy(np.array([[5, 6, 7, 8, 9]], np.int64))
    np.testing.assert_array_equal(client.infer("emb", [good]).as_numpy("emb")[0], TABLE[5:10])
