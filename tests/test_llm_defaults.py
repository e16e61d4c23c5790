"""Defaults sized for the model: its generation_config.json's sampling for what a request
leaves unset, an answer length capped on the server, and a KV pool sized from the model and
the memory when the config sets none."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rtserve.runtime.llm.defaults import KV_MAX_BYTES, SamplingDefaults, kv_pool_bytes
from rtserve.runtime.llm.params import SamplingParams
from tests.conftest import RunningServer, post_json, start_server
from tests.llm_models import build_llm


def test_generation_config_fills_only_what_the_request_left_unset(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_new_tokens": 30})
    )
    defaults = SamplingDefaults.load(tmp_path)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.2, 0.9, 40)
    unset = SamplingParams.from_mapping({}, default_max_tokens=None)
    got = defaults.apply(unset, n_prompt=10, max_model_len=2048, cap=256)
    assert (got.temperature, got.top_p, got.top_k, got.max_tokens) == (0.2, 0.9, 40, 30)
    asked = SamplingParams.from_mapping({"temperature": 0, "top_p": 1, "max_tokens": 500})
    got = defaults.apply(asked, n_prompt=10, max_model_len=2048, cap=256)
    assert (got.temperature, got.top_p, got.top_k, got.max_tokens) == (0.0, 1.0, 40, 500)
    # No file: OpenAI's sampling; the length capped by the server and by the context.
    none = SamplingDefaults.load(tmp_path / "absent")
    got = none.apply(unset, n_prompt=10, max_model_len=2048, cap=256)
    assert (got.temperature, got.top_p, got.top_k, got.max_tokens) == (1.0, 1.0, 0, 256)
    assert none.apply(unset, n_prompt=2000, max_model_len=2048, cap=256).max_tokens == 48
    # Built directly (not from a request): nothing is replaced.
    direct = SamplingParams(max_tokens=5)
    assert defaults.apply(direct, 10, 2048, 256) == direct


def test_a_bad_generation_config_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot", "top_p": 0.5}')
    defaults = SamplingDefaults.load(tmp_path)
    assert defaults.temperature is None and defaults.top_p == 0.5
    assert "temperature 'hot' ignored" in caplog.text


def test_kv_pool_is_what_the_sequences_need_bounded_by_memory() -> None:
    per_token, block = 256, 16
    size, why = kv_pool_bytes(per_token, 512, 64, block, available=8 << 30)
    assert size == 64 * 512 * per_token and "64 sequences x 512 tokens" in why
    # A big model on a small machine: a quarter of what is available, whole blocks.
    size, _ = kv_pool_bytes(46080, 2048, 64, block, available=2 << 30)
    assert size <= (2 << 30) // 4 and size % (46080 * block) == 0
    # ...but never less than one full-length sequence, nor more than the ceiling.
    size, _ = kv_pool_bytes(46080, 2048, 64, block, available=1 << 20)
    assert size == 2048 * 46080
    size, _ = kv_pool_bytes(1 << 20, 4096, 256, block, available=1 << 40)
    assert size == KV_MAX_BYTES


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A tiny random Llama with no ``kv_cache_bytes``, a generation_config.json asking for
    greedy sampling, and ``default_max_tokens: 7``."""
    root = tmp_path_factory.mktemp("llm-defaults")
    version = build_llm(root, "tiny", llm={"default_max_tokens": 7, "max_num_seqs": 4})
    config_path = root / "tiny" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    del config["llm"]["kv_cache_bytes"]
    config_path.write_text(yaml.safe_dump(config))
    gen_config = json.loads((version / "generation_config.json").read_text())
    gen_config.update({"do_sample": False, "temperature": 0.0})
    (version / "generation_config.json").write_text(json.dumps(gen_config))
    server = start_server(root, tmp_path_factory.mktemp("llm-defaults-server"))
    yield server
    server.stop()


def test_a_chat_without_max_tokens_stops_at_default_max_tokens(tiny: RunningServer) -> None:
    doc = {"model": "tiny", "messages": [{"role": "user", "content": "The new movie is"}]}
    status, answer = post_json(f"{tiny.base}/v1/chat/completions", doc)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] <= 7, answer["usage"]
    # The model's own sampling (greedy) applies to what the request left unset.
    again = post_json(f"{tiny.base}/v1/chat/completions", doc)[1]
    text = answer["choices"][0]["message"]["content"]
    assert again["choices"][0]["message"]["content"] == text
    greedy = post_json(f"{tiny.base}/v1/chat/completions", {**doc, "temperature": 0})[1]
    assert greedy["choices"][0]["message"]["content"] == text
    # An explicit max_tokens is the request's own (over the server's default).
    long = {**doc, "max_tokens": 20, "stop_token_ids": [], "ignore_eos": True}
    status, answer = post_json(f"{tiny.base}/v1/chat/completions", long)
    assert status == 200 and answer["usage"]["completion_tokens"] == 20, answer


def test_a_bare_llm_config_gets_a_small_kv_pool_and_logs_why(tiny: RunningServer) -> None:
    log = tiny.log()
    m = re.search(r"KV pool (\d+) MiB \((4 sequences x 512 tokens x \d+ B)", log)
    assert m, log[-3000:]
    assert int(m.group(1)) < 8, m.group(0)  # 4 x 512 tokens of a 2-layer model: ~1 MiB
    assert "temperature 0 (generation_config.json)" in log


def test_the_prepacking_log_counts_the_fused_layers_weights(tiny: RunningServer) -> None:
    """Every linear weight is prepacked (the fused layers pack their own): the log says so,
    4 GEMMs a layer (q/k/v, o, gate/up, down) for the 2-layer model, not only the leftovers."""
    m = re.search(r"(\d+) GEMM weights prepacked for oneDNN", tiny.log())
    assert m and int(m.group(1)) >= 2 * 4, tiny.log()[-3000:]
