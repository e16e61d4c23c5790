"""``/v1/embeddings`` over an encoder that outputs token states, pooled as its config's
``embedding:`` section says: a real ONNX encoder (built here: embeddings, a masked running
sum along the sequence, tanh) served by a live server; the vectors must equal numpy's
pooling of the V2 route's raw ``[batch, seq, hidden]`` answer."""

from __future__ import annotations

import base64
import concurrent.futures
import importlib.util
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

onnx = pytest.importorskip("onnx")
tokenizers = pytest.importorskip("tokenizers")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from rtserve.config import parse_model_config  # noqa: E402
from rtserve.errors import ConfigError  # noqa: E402
from tests.conftest import RunningServer, post_json, start_server  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HIDDEN = 16
WORDS = [
    "the",
    "a",
    "man",
    "woman",
    "is",
    "eating",
    "food",
    "bread",
    "sky",
    "blue",
    "red",
    "green",
    "cat",
    "dog",
    "runs",
    "sleeps",
]
TEXTS = ["the man is eating food", "a cat sleeps", "the sky is blue red green and the dog runs"]
SECTIONS: dict[str, dict[str, Any]] = {
    "enc-mean": {"output": "last_hidden_state", "pooling": "mean", "dimensions": [4, 8]},
    "enc-cls": {"pooling": "cls", "tokenizer": "vocab"},
    "enc-last": {"pooling": "last", "normalize": False, "max_length": 12},
    "enc-misfit": {"output": "pooled_output"},
}


def _encoder(path: Path) -> None:
    """ids, mask -> tanh(cumsum(E[ids] * mask, seq)): [batch, seq, 16]; real tokens' states
    do not depend on the padding after them, and each position differs."""
    table = np.random.default_rng(7).normal(size=(len(WORDS) + 2, HIDDEN)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["x"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "axis2"], ["m3"]),
        helper.make_node("Mul", ["x", "m3"], ["xm"]),
        helper.make_node("CumSum", ["xm", "axis1"], ["c"]),
        helper.make_node("Tanh", ["c"], ["last_hidden_state"]),
    ]
    ids = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
           for n in ("input_ids", "attention_mask")]  # fmt: skip
    out = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT,
                                        ["batch", "seq", HIDDEN])  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "encoder",
        ids,
        [out],
        [
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array([2], np.int64), "axis2"),
            numpy_helper.from_array(np.array(1, np.int64), "axis1"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


TORCH_NET = f"""
import numpy as np
import torch


class Encoder(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.register_buffer("table", torch.from_numpy(table))

    def forward(self, input_ids, attention_mask):
        x = self.table[input_ids] * attention_mask.unsqueeze(-1).to(torch.float32)
        return torch.tanh(torch.cumsum(x, dim=1))


def build():
    rng = np.random.default_rng(7)
    return Encoder(rng.normal(size=({len(WORDS) + 2}, {HIDDEN})).astype(np.float32))
"""


def _torch_encoder(model: Path) -> None:
    """The ONNX encoder's function as a torch module (the torch backend's factory)."""
    (model / "1").mkdir(parents=True)
    (model / "1" / "net.py").write_text(TORCH_NET)
    _tokenizer().save(str(model / "1" / "tokenizer.json"))
    ids = [{"name": n, "datatype": "INT64", "shape": [-1]} for n in ("input_ids", "attention_mask")]
    config = {
        "backend": "torch",
        "max_batch_size": 16,
        "inputs": ids,
        "outputs": [{"name": "last_hidden_state", "datatype": "FP32", "shape": [-1, HIDDEN]}],
        "torch": {"factory": "net:build"},
        "embedding": {"pooling": "mean"},
    }
    (model / "config.yaml").write_text(yaml.safe_dump(config))


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("pooling-repo")
    for name, section in SECTIONS.items():
        (root / name / "1").mkdir(parents=True)
        _encoder(root / name / "1" / "model.onnx")
        config = {
            "max_batch_size": 16,
            "dynamic_batching": {"max_queue_delay_us": 20000, "adaptive_delay": False},
            "embedding": section,
        }
        (root / name / "config.yaml").write_text(yaml.safe_dump(config))
        if section.get("tokenizer") == "vocab":
            (root / name / "vocab").mkdir()
            _tokenizer().save(str(root / name / "vocab" / "tokenizer.json"))
        else:
            _tokenizer().save(str(root / name / "1" / "tokenizer.json"))
    if HAVE_TORCH:
        _torch_encoder(root / "enc-torch")
    running = start_server(root, tmp_path_factory.mktemp("pooling-work"))
    yield running
    running.stop()


def _ids(texts: list[str]) -> list[list[int]]:
    return [e.ids for e in _tokenizer().encode_batch(texts)]


def _v2_states(server: RunningServer, model: str, rows: list[list[int]]) -> np.ndarray:
    """The V2 route's raw token states for ``rows`` padded to the longest."""
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    mask = (np.arange(width)[None, :] < np.array([len(r) for r in rows])[:, None]).astype(int)
    inputs = [
        {"name": n, "datatype": "INT64", "shape": list(a.shape), "data": a.ravel().tolist()}
        for n, a in (("input_ids", ids), ("attention_mask", mask))
    ]
    status, doc = post_json(f"{server.base}/v2/models/{model}/infer", {"inputs": inputs})
    assert status == 200, doc
    (out,) = doc["outputs"]
    return np.array(out["data"], np.float32).reshape(out["shape"])


def _embed(server: RunningServer, doc: dict[str, Any]) -> tuple[int, Any]:
    return post_json(f"{server.base}/v1/embeddings", doc)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def test_mean_pooling_equals_numpy_over_the_v2_token_states(server: RunningServer) -> None:
    rows = _ids(TEXTS)
    states = _v2_states(server, "enc-mean", rows)
    lengths = np.array([len(r) for r in rows])
    mask = (np.arange(states.shape[1])[None, :] < lengths[:, None]).astype(np.float32)
    expected = _unit((states * mask[:, :, None]).sum(1) / lengths[:, None])
    status, doc = _embed(server, {"model": "enc-mean", "input": TEXTS})
    assert status == 200, doc
    got = np.array([d["embedding"] for d in doc["data"]], np.float32)
    assert got.shape == (3, HIDDEN)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert doc["usage"]["prompt_tokens"] == int(lengths.sum())
    # Token ids give the very same vectors.
    status, by_ids = _embed(server, {"model": "enc-mean", "input": rows})
    assert status == 200, by_ids
    np.testing.assert_allclose([d["embedding"] for d in by_ids["data"]], got, atol=1e-6)


@pytest.mark.skipif(not HAVE_TORCH, reason="needs torch")
def test_a_torch_encoder_pools_to_the_onnx_encoder_s_vectors(server: RunningServer) -> None:
    status, onnx_doc = _embed(server, {"model": "enc-mean", "input": TEXTS})
    assert status == 200, onnx_doc
    status, torch_doc = _embed(server, {"model": "enc-torch", "input": TEXTS})
    assert status == 200, torch_doc
    np.testing.assert_allclose(
        [d["embedding"] for d in torch_doc["data"]],
        [d["embedding"] for d in onnx_doc["data"]],
        rtol=1e-5,
        atol=1e-6,
    )


def test_cls_pooling_is_the_first_token_with_a_tokenizer_directory(server: RunningServer) -> None:
    rows = _ids(TEXTS)
    states = _v2_states(server, "enc-cls", rows)
    status, doc = _embed(server, {"model": "enc-cls", "input": TEXTS, "encoding_format": "base64"})
    assert status == 200, doc
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in doc["data"]])
    np.testing.assert_allclose(got, _unit(states[:, 0, :]), rtol=1e-5, atol=1e-6)


def test_last_pooling_is_the_last_real_token_unnormalized(server: RunningServer) -> None:
    rows = _ids(TEXTS)
    states = _v2_states(server, "enc-last", rows)
    expected = np.stack([states[i, len(r) - 1] for i, r in enumerate(rows)])
    status, doc = _embed(server, {"model": "enc-last", "input": TEXTS})
    assert status == 200, doc
    got = np.array([d["embedding"] for d in doc["data"]], np.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0)


def test_dimensions_truncate_and_renormalize_where_the_section_allows(
    server: RunningServer,
) -> None:
    rows = _ids(TEXTS[:1])
    states = _v2_states(server, "enc-mean", rows)
    full = states[0].mean(0)
    status, doc = _embed(server, {"model": "enc-mean", "input": TEXTS[0], "dimensions": 8})
    assert status == 200, doc
    np.testing.assert_allclose(doc["data"][0]["embedding"], _unit(full[:8]), rtol=1e-5, atol=1e-6)
    status, doc = _embed(server, {"model": "enc-mean", "input": TEXTS[0], "dimensions": 5})
    assert status == 400
    assert "dimensions" in doc["error"]["message"] and "4 or 8 or 16" in doc["error"]["message"]
    status, doc = _embed(server, {"model": "enc-cls", "input": TEXTS[0], "dimensions": 8})
    assert status == 400 and "dimensions" in doc["error"]["message"]


def test_an_input_over_max_length_is_refused_naming_it(server: RunningServer) -> None:
    long_text = " ".join(WORDS[:13])
    status, doc = _embed(server, {"model": "enc-last", "input": ["a cat", long_text]})
    assert status == 400, doc
    assert "input[1]" in doc["error"]["message"] and "max_length" in doc["error"]["message"]


def test_a_section_that_does_not_fit_the_model_says_which_field(server: RunningServer) -> None:
    status, doc = _embed(server, {"model": "enc-misfit", "input": "a cat"})
    assert status == 500, doc
    assert "embedding.output" in doc["error"]["message"]
    assert "last_hidden_state" in doc["error"]["message"]  # (the outputs it has)
    with urllib.request.urlopen(f"{server.base}/v1/models", timeout=10) as r:
        import json

        listed = {m["id"]: m for m in json.loads(r.read())["data"]}
    assert listed["enc-mean"]["dimensions"] == HIDDEN
    assert "enc-misfit" not in listed


def _batches(server: RunningServer, model: str) -> tuple[float, float]:
    """(batches run, rows run) of ``model`` so far, from ``/metrics``."""
    with urllib.request.urlopen(f"{server.base}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    found = [
        re.search(rf'rtserve_batch_size_{what}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)', metrics)
        for what in ("count", "sum")
    ]
    assert found[0] and found[1], metrics[:2000]
    return float(found[0].group(1)), float(found[1].group(1))


def test_concurrent_requests_share_batches_of_the_dynamic_batcher(server: RunningServer) -> None:
    texts = [f"the {w} runs" for w in WORDS[:12]]  # (one width: 3 tokens, padded to 8)

    def one(text: str) -> list[float]:
        status, doc = _embed(server, {"model": "enc-last", "input": text})
        assert status == 200, doc
        return list(doc["data"][0]["embedding"])

    batches, rows_run = _batches(server, "enc-last")
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        vectors = list(pool.map(one, texts))
    after = _batches(server, "enc-last")
    assert after[1] - rows_run == 12
    assert after[0] - batches < 12  # (some batch held several requests)
    states = _v2_states(server, "enc-last", _ids(texts))
    np.testing.assert_allclose(vectors, states[:, 2, :], rtol=1e-5, atol=1e-6)


def test_the_openai_client_embeds_and_retrieves_a_pooled_model(server: RunningServer) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0)
    model = client.models.retrieve("enc-mean")
    assert model.id == "enc-mean" and model.dimensions == HIDDEN
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("enc-misfit")
    assert info.value.body["code"] == "model_not_found"
    by_base64 = client.embeddings.create(model="enc-mean", input=TEXTS, dimensions=4)
    by_float = client.embeddings.create(
        model="enc-mean", input=TEXTS, dimensions=4, encoding_format="float"
    )
    got = np.array([d.embedding for d in by_base64.data], np.float32)
    assert got.shape == (3, 4)
    np.testing.assert_allclose(got, [d.embedding for d in by_float.data], atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"pooling": "max"}, "embedding.pooling"),
        ({"normalize": "yes"}, "embedding.normalize"),
        ({"tokenizer": "../elsewhere/tokenizer.json"}, "embedding.tokenizer"),
        ({"max_length": 0}, "embedding.max_length"),
        ({"dimensions": [0]}, "embedding.dimensions"),
        ({"mask": "input_ids"}, "embedding.mask"),
        ({"pool": "mean"}, "embedding.pool"),
        ("mean", "embedding"),
    ],
)
def test_a_bad_embedding_section_is_a_config_error_naming_the_field(
    section: Any, field: str
) -> None:
    with pytest.raises(ConfigError, match=rf"models/enc/config.yaml: {re.escape(field)}: "):
        parse_model_config({"embedding": section}, "enc", "models/enc/config.yaml")


def test_an_unloaded_model_leaves_the_embedder_cache(tmp_path: Path) -> None:
    from rtserve.engine import Engine
    from rtserve.server import embeddings

    for name in ("enc-a", "enc-b"):
        (tmp_path / name / "1").mkdir(parents=True)
        _encoder(tmp_path / name / "1" / "model.onnx")
        (tmp_path / name / "config.yaml").write_text(
            yaml.safe_dump({"max_batch_size": 4, "embedding": {"pooling": "mean"}})
        )
    with Engine.from_repository(tmp_path, model_control_mode="explicit").sync() as engine:
        engine.load("enc-a")
        engine.load("enc-b")
        dataplane = engine.engine.dataplane
        a = dataplane.registry.get_loaded("enc-a")
        assert embeddings.embedder(dataplane, a) is not None
        assert any(held is a for held, _ in embeddings._EMBEDDERS.values())
        engine.unload("enc-a")
        del a
        b = dataplane.registry.get_loaded("enc-b")
        assert embeddings.embedder(dataplane, b) is not None  # a miss drops unloaded versions
        held = [v.config.name for v, _ in embeddings._EMBEDDERS.values()]
        assert held == ["enc-b"]
