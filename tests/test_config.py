"""Model config validation: every error names the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rtserve.config import load_server_config, load_yaml, parse_model_config
from rtserve.errors import ConfigError

WHERE = "repo/m/config.yaml"


def parse(text: str):
    return parse_model_config(yaml.safe_load(text), "m", WHERE)


def test_full_config_is_parsed() -> None:
    cfg = parse(
        """
max_batch_size: 16
inputs: [{name: a, datatype: FP32, shape: [3, -1]}]
outputs: [{name: b, datatype: INT64, shape: []}]
dynamic_batching: {max_queue_delay_us: 250, preferred_batch_sizes: [16, 4], max_queue_size: 10}
instance_count: 2
onnxruntime: {intra_op_threads: 2, inter_op_threads: 1, graph_optimization_level: basic,
              execution_providers: [TensorRT, CUDA, CPU], execution: thread}
warmup: {batch_sizes: [1, 16], iterations: 1}
version_policy: {specific: [1, 3]}
"""
    )
    assert cfg.max_batch_size == 16 and cfg.instance_count == 2
    assert cfg.inputs is not None and cfg.inputs[0].shape == (3, -1)
    assert cfg.dynamic_batching.preferred_batch_sizes == (4, 16)
    assert cfg.onnxruntime.execution_providers == ("TensorRT", "CUDA", "CPU")
    assert cfg.version_policy == "specific" and cfg.versions == (1, 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_batch_size: -1", "max_batch_size: expected an integer >= 0, got -1"),
        ("max_batch_size: lots", "max_batch_size: expected an integer >= 0, got 'lots'"),
        (
            "dynamic_batching: {max_queue_size: 0}",
            "dynamic_batching.max_queue_size: expected an integer >= 1",
        ),
        ("dynamic_batching: {delay: 5}", "dynamic_batching.delay: unknown field"),
        (
            "max_batch_size: 4\ndynamic_batching: {preferred_batch_sizes: [8]}",
            "preferred_batch_sizes: expected sizes <= max_batch_size (4)",
        ),
        (
            "inputs: [{name: a, datatype: FLOAT32, shape: [1]}]",
            "inputs[0].datatype: expected one of",
        ),
        ("inputs: [{name: a, datatype: FP32, shape: 3}]", "inputs[0].shape: expected a list"),
        (
            "onnxruntime: {graph_optimization_level: max}",
            "onnxruntime.graph_optimization_level: expected one of",
        ),
        (
            "onnxruntime: {execution_providers: [GPU]}",
            "onnxruntime.execution_providers: expected a list drawn from",
        ),
        ("instance_count: 0", "instance_count: expected an integer >= 1"),
        ("name: other", "name: expected the directory name 'm'"),
        (
            "version_policy: newest",
            "version_policy: expected all, latest, {latest: {num_versions: N}}",
        ),
        ("version_policy: {specific: []}", "version_policy: expected specific: a non-empty"),
        ("version_policy: {latest: {num_versions: 0}}", "latest.num_versions: an integer >= 1"),
        ("batch: 3", "batch: unknown field"),
        ("torch: {device: cpu}", "torch: options of backend torch, but the backend is onnxruntime"),
        ("- 1\n- 2", "config: expected a mapping"),
    ],
)
def test_errors_name_the_file_and_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert str(info.value).startswith(WHERE)
    assert message in str(info.value)


ENSEMBLE = """
backend: ensemble
inputs: [{name: X, datatype: FP32, shape: [4]}]
outputs: [{name: Y, datatype: FP32, shape: [4]}]
steps: [{model: double, inputs: {x: X}, outputs: {y: Y}}]
"""


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("slo", "slo: {p99_ms: 50}"),
        ("priority_levels", "priority_levels: 2"),
        ("default_priority", "default_priority: 1"),
    ],
)
def test_an_ensemble_refuses_latency_objectives_and_priority_levels(field: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(ENSEMBLE + text)
    assert str(info.value).startswith(f"{WHERE}: {field}: expected no ")
    assert f"on an ensemble (set {field} on its step models)" in str(info.value)


def test_invalid_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("max_batch_size: [1,\n")
    with pytest.raises(ConfigError, match=str(path)):
        load_yaml(path)


def test_server_config_file_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(
        "model_repository: /models\nhttp_port: 9000\nresponse_cache: {memory: {max_bytes: 1000}}\n"
    )
    cfg = load_server_config(path, http_port=9100, grpc_port=None)
    assert (
        cfg.model_repository == Path("/models") and cfg.http_port == 9100 and cfg.grpc_port == 8001
    )
    assert cfg.response_cache == {"memory": {"max_bytes": 1000}}
    path.write_text("model_repository: /models\nports: 1\n")
    with pytest.raises(ConfigError, match="ports: unknown field"):
        load_server_config(path)


@pytest.mark.parametrize(
    ("text", "policy", "versions"),
    [
        ("version_policy: {latest: {num_versions: 2}}", "latest", (2,)),
        ("version_policy: {latest: {}}", "latest", (1,)),
        ("version_policy: latest", "latest", (1,)),
        ("version_policy: {specific: {versions: [2, 3]}}", "specific", (2, 3)),
        ("version_policy: {all: {}}", "all", ()),
    ],
)
def test_version_policies_in_tritons_form_too(text: str, policy: str, versions: tuple) -> None:
    cfg = parse(text)
    assert (cfg.version_policy, cfg.versions) == (policy, versions)
