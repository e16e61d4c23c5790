"""The bundled generative example (``make examples``): SmolLM2-135M-Instruct converted to FP32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from examples.build_llm import LLM_CONFIG, MODEL_NAME, build_llm_repository, check_answer
from tests.conftest import ROOT

BUILT = ROOT / "examples" / "llm-repository"


@pytest.fixture(scope="module")
def version_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory `make examples` built, else a fresh build (cached wheel and conversion)."""
    if (BUILT / ".built").exists():
        return BUILT / MODEL_NAME / "1"
    return build_llm_repository(tmp_path_factory.mktemp("llm-repository"))


def test_the_example_is_a_plain_fp32_transformers_directory(version_dir: Path) -> None:
    names = {p.name for p in version_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((version_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 49152
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (version_dir / "model.safetensors").stat().st_size > 500_000_000  # 134.5M x 4 bytes


def test_the_model_config_selects_the_llm_backend(version_dir: Path) -> None:
    config = yaml.safe_load((version_dir.parent / "config.yaml").read_text())
    assert config == yaml.safe_load(LLM_CONFIG)
    assert config["backend"] == "llm" and config["llm"]["dtype"] == "float32"
    assert config["llm"]["kv_cache_bytes"] == 512 * 2**20


def test_the_converted_weights_answer_a_chat_question(version_dir: Path) -> None:
    """Greedy, chat template applied: the dequantized weights are the real model's."""
    assert check_answer(version_dir) == "The capital of France is Paris."


def test_the_example_carries_its_recommended_sampling(version_dir: Path) -> None:
    """generation_config.json: SmolLM2-Instruct's card sampling, which requests that set no
    temperature/top_p get; the token ids the conversion wrote are kept."""
    doc = json.loads((version_dir / "generation_config.json").read_text())
    assert doc["temperature"] == 0.2 and doc["top_p"] == 0.9 and doc["eos_token_id"] == 2
    request = json.loads((version_dir.parent / "example_request.json").read_text())
    assert request["temperature"] == 0 and request["max_tokens"] <= 64
