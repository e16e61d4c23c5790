"""llama.cpp's ``llama-server`` as a generative peer: the example SmolLM2 converted to GGUF
(F32, BF16, Q8_0 with the tree's ``convert_hf_to_gguf.py``; Q4_K_M with ``llama-quantize``),
cached under ``bench/.peers/llamacpp/models/``. One 16k-token KV cache shared by the 32
slots (``--kv-unified``: a 1,000-token prompt fits in any slot). The build (``bench/.peers/llamacpp/tree``,
CMake + Ninja, ``-DLLAMA_CURL=OFF -DGGML_NATIVE=ON``) is made once beforehand.

llama.cpp spins its threads: on a busy machine its figures collapse; measure it quiet.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from bench import envs, procs

HOME = envs.PEERS_DIR / "llamacpp"
TREE = HOME / "tree"
BIN = TREE / "build" / "bin"
MODELS = HOME / "models"
SOURCE = envs.ROOT / "examples" / "llm-repository" / "smollm2" / "1"
QUANTS = ("f32", "bf16", "q8_0", "q4_k_m")  # the first three straight from the converter


def gguf(quant: str) -> Path:
    """The example model as GGUF in ``quant``, converted (or quantized from F32) on first use.
    The converter needs ``sentencepiece`` and ``gguf-py``: it runs in vLLM's venv."""
    out = MODELS / f"smollm2-{quant}.gguf"
    if out.is_file():
        return out
    MODELS.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    if quant in ("f32", "bf16", "q8_0"):
        python = envs.peer_env("vllm").python
        env = dict(os.environ, PYTHONPATH=str(TREE / "gguf-py"))
        argv = [str(python), str(TREE / "convert_hf_to_gguf.py"), str(SOURCE)]
        argv += ["--outtype", quant, "--outfile", str(tmp)]
        subprocess.run(argv, env=env, check=True, capture_output=True)
    else:
        argv = [str(BIN / "llama-quantize"), str(gguf("f32")), str(tmp), quant.upper(), "2"]
        subprocess.run(argv, check=True, capture_output=True)
    tmp.rename(out)
    return out


def start(work: Path, port: int, quant: str, model: str) -> procs.Server:
    argv = [
        str(BIN / "llama-server"), "-m", str(gguf(quant)), "--alias", model,
        "--host", "127.0.0.1", "--port", str(port),
        "-c", "16384", "--parallel", "32", "--kv-unified", "-t", "2", "--no-webui",
    ]  # fmt: skip
    env = dict(os.environ, LD_LIBRARY_PATH=str(BIN))
    return procs.Server(f"llamacpp-{quant}", argv, env, work / f"llamacpp-{quant}.log", work)
