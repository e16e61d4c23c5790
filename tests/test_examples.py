"""The bundled pipeline examples (``make examples``), served and queried like a user would."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from examples.build_repository import EXAMPLE_HEADER_BYTES, build_repository, sample_jpeg
from tests.conftest import ROOT, RunningServer, start_server

BUILT = ROOT / "examples" / "repository"
CAT_CLASSES = {
    "tabby, tabby cat",
    "tiger cat",
    "Persian cat",
    "Siamese cat, Siamese",
    "Egyptian cat",
}
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "Interest rates rose again this quarter.",
]


@pytest.fixture(scope="module")
def examples_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository `make examples` built, or a fresh build when it lacks the pipelines."""
    if (BUILT / ".built").exists() and (BUILT / "text-embedding" / "config.yaml").exists():
        return BUILT
    return build_repository_once(tmp_path_factory.mktemp("examples"))


def build_repository_once(out: Path) -> Path:
    build_repository(out)
    return out


@pytest.fixture(scope="module")
def served(
    examples_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    s = start_server(examples_repo, tmp_path_factory.mktemp("examples-server"), timeout=180)
    yield s
    s.stop()


def _embed_http(server: RunningServer, sentences: list[str]) -> np.ndarray:
    text = np.array([[s.encode()] for s in sentences], dtype=object)
    with thttp.InferenceServerClient(server.http) as client:
        t = thttp.InferInput("TEXT", list(text.shape), "BYTES")
        t.set_data_from_numpy(text)
        return client.infer("text-embedding", [t]).as_numpy("EMBEDDING")


def test_text_embedding_gives_unit_norm_vectors_that_rank_paraphrases_first(
    served: RunningServer,
) -> None:
    emb = _embed_http(served, SENTENCES)
    assert emb.shape == (4, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-3)
    cos = emb @ emb.T
    assert cos[0, 1] > 0.6, cos[0, 1]
    assert cos[0, 1] > max(cos[0, 2], cos[0, 3]) + 0.3, cos


def test_text_embedding_matches_sentence_transformers(served: RunningServer) -> None:
    """The INT8 pipeline stays close to the FP32 reference model (same weights, PyTorch)."""
    from sentence_transformers import SentenceTransformer

    from rtserve.optimize.text import minilm_path, offline

    offline()
    reference = SentenceTransformer(str(minilm_path()), device="cpu").encode(
        SENTENCES, normalize_embeddings=True
    )
    emb = _embed_http(served, SENTENCES)
    agreement = np.sum(emb * reference, axis=1)
    assert agreement.min() > 0.95, agreement


def test_text_embedding_over_grpc_equals_http_and_requests_of_one_row(
    served: RunningServer,
) -> None:
    together = _embed_http(served, SENTENCES[:2])
    with tgrpc.InferenceServerClient(served.grpc) as client:
        for i, sentence in enumerate(SENTENCES[:2]):
            t = tgrpc.InferInput("TEXT", [1, 1], "BYTES")
            t.set_data_from_numpy(np.array([[sentence.encode()]], dtype=object))
            alone = client.infer("text-embedding", [t]).as_numpy("EMBEDDING")
            # The mask hides the padding, but dynamic INT8 quantizes activations with one
            # scale per batch: a row's batch mates move its embedding a little.
            assert float(alone[0] @ together[i]) > 0.98


def _classify(server: RunningServer, images: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    data = np.array([[im] for im in images], dtype=object)
    with thttp.InferenceServerClient(server.http) as client:
        t = thttp.InferInput("IMAGE", list(data.shape), "BYTES")
        t.set_data_from_numpy(data)
        result = client.infer("image-classifier", [t])
        return result.as_numpy("LABELS"), result.as_numpy("SCORES")


def _png_of_chelsea() -> bytes:
    from PIL import Image
    from skimage import data

    buf = io.BytesIO()
    Image.fromarray(data.chelsea()).save(buf, format="PNG")
    return buf.getvalue()


def test_image_classifier_finds_the_cat_in_jpeg_and_png(served: RunningServer) -> None:
    labels, scores = _classify(served, [sample_jpeg(), _png_of_chelsea()])
    assert labels.shape == (2, 5) and scores.shape == (2, 5)
    for row in range(2):
        names = {b.decode() for b in labels[row]}
        assert len(names) == 5
        assert names & CAT_CLASSES, names
        assert labels[row][0].decode() in CAT_CLASSES
        assert np.all(np.diff(scores[row]) <= 0) and 0 < scores[row].sum() <= 1.0001


def test_a_file_that_is_not_an_image_names_the_decode_step(served: RunningServer) -> None:
    with pytest.raises(InferenceServerException) as info:
        _classify(served, [b"this is not an image"])
    assert "image-classifier" in str(info.value) and "image-preprocess" in str(info.value)
    assert "UnidentifiedImageError" in str(info.value)
    labels, _ = _classify(served, [sample_jpeg()])
    assert labels.shape == (1, 5)


def test_readme_example_requests_work(served: RunningServer, examples_repo: Path) -> None:
    """The bodies the README's curl lines send."""
    text = httpx.post(
        f"{served.base}/v2/models/text-embedding/infer",
        content=(examples_repo / "text-embedding" / "example_request.json").read_bytes(),
        timeout=30,
    )
    assert text.status_code == 200, text.text
    assert text.json()["outputs"][0]["shape"] == [2, 384]
    image = httpx.post(
        f"{served.base}/v2/models/image-classifier/infer",
        content=(examples_repo / "image-classifier" / "example_request.bin").read_bytes(),
        headers={"Inference-Header-Content-Length": str(EXAMPLE_HEADER_BYTES)},
        timeout=30,
    )
    assert image.status_code == 200, image.text
    outputs = {o["name"]: o for o in image.json()["outputs"]}
    assert set(outputs["LABELS"]["data"]) & CAT_CLASSES
