"""Tokens per second at one stream for each ``llm.weights`` format of SmolLM2-135M-Instruct,
through the server, and the memory-bandwidth ceiling of each.

One rtserve process serves the model four times (``smollm2-fp32``, ``-bf16``, ``-int8``,
``-int4``: the same checkpoint, ``llm.weights`` set in each config.yaml). Each round sends,
to each model in turn (the order rotates between rounds), ``requests`` greedy chat streams
one after another ("Write a short story number i about a cat.", ``max_tokens`` new tokens,
ignore_eos): output tok/s = tokens / wall time of the round's requests, TTFT and the median
gap between tokens. The report quotes the median over rounds and shows every round.

The ceiling: linear-weight bytes a decode step reads per token (``quant.model_bytes``) over
the bandwidth this machine reads memory at (a 1 GiB float32 sum with the server's threads).

    python -m bench.llm_weights --rounds 5 --requests 3 --max-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench import procs
from bench.clients.sse import chat_body, closed_loop

ROOT = Path(__file__).resolve().parent.parent
VERSION = ROOT / "examples" / "llm-repository" / "smollm2" / "1"
FORMATS = ("fp32", "bf16", "int8", "int4")


def repository(root: Path) -> Path:
    base = yaml.safe_load((VERSION.parent / "config.yaml").read_text())
    for fmt in FORMATS:
        model = root / f"smollm2-{fmt}"
        model.mkdir(parents=True)
        (model / "1").symlink_to(VERSION)
        config = dict(base)
        config["llm"] = {**base["llm"], "weights": fmt}
        (model / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def bandwidth_gbs(threads: int = 2, gib: float = 1.0) -> float:
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        float(x.sum())
        best = max(best, x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


def weight_bytes() -> dict[str, float]:
    """MB of linear weights read per token, from a model loaded as the server loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    from rtserve.llm import quant

    out = {}
    for fmt in FORMATS:
        model = AutoModelForCausalLM.from_pretrained(VERSION, dtype=torch.float32)
        if fmt != "fp32":
            quant.plan(model, fmt)
            make = quant.maker(None)
            for parent in list(model.modules()):
                for name, child in list(parent.named_children()):
                    if type(child) is torch.nn.Linear:
                        setattr(parent, name, make(child))
        out[fmt] = quant.model_bytes(model) / 1e6
    return out


async def one_round(base: str, order: list[str], requests: int, max_tokens: int, i: int) -> dict:
    out = {}
    for fmt in order:
        bodies = [
            chat_body(
                f"smollm2-{fmt}",
                [
                    {
                        "role": "user",
                        "content": f"Write a short story number {i * 10 + j} about a cat.",
                    }
                ],
                max_tokens,
            )
            for j in range(requests)
        ]
        streams, wall = await closed_loop(base + "/v1/chat/completions", bodies, 1)
        errors = [s.error for s in streams if s.error]
        if errors:
            raise RuntimeError(f"{fmt}: {errors[0]}")
        tokens = sum(s.tokens for s in streams)
        itls = [g for s in streams for g in s.itls]
        out[fmt] = {
            "tok_s": tokens / wall,
            "ttft_ms": 1000 * statistics.median(s.ttft or 0.0 for s in streams),
            "itl_ms": 1000 * statistics.median(itls),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="llm-weights-"))
    repo = repository(work / "repo")
    port = procs.free_port()
    argv_ = [
        sys.executable, "-m", "rtserve.cli", "serve", "--model-repository", str(repo),
        "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "0",
    ]  # fmt: skip
    server = procs.Server("rtserve", argv_, {}, work / "rtserve.log", ROOT)
    rounds = []
    try:
        base = f"http://127.0.0.1:{port}"
        server.wait_ready(base + "/v2/health/ready", timeout_s=900)
        asyncio.run(one_round(base, list(FORMATS), 1, 16, 99))  # warm up each model
        for i in range(args.rounds):
            order = list(FORMATS[i % 4 :] + FORMATS[: i % 4])
            rounds.append(asyncio.run(one_round(base, order, args.requests, args.max_tokens, i)))
            print(f"round {i + 1}: " + ", ".join(
                f"{f} {rounds[-1][f]['tok_s']:.0f}" for f in FORMATS), flush=True)  # fmt: skip
    finally:
        server.stop()
    gbs = bandwidth_gbs()
    mb = weight_bytes()
    print(f"\nmemory read bandwidth (2 threads, 1 GiB sum): {gbs:.1f} GB/s\n")
    print("| weights | tok/s at 1 stream (median) | rounds | TTFT p50 ms | ITL p50 ms | "
          "MB read per token | ceiling tok/s | of ceiling |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for fmt in FORMATS:
        tps = [r[fmt]["tok_s"] for r in rounds]
        med = statistics.median(tps)
        ceiling = gbs * 1e3 / mb[fmt]
        print(
            f"| {fmt} | {med:.0f} | {' / '.join(f'{t:.0f}' for t in tps)} | "
            f"{statistics.median(r[fmt]['ttft_ms'] for r in rounds):.0f} | "
            f"{statistics.median(r[fmt]['itl_ms'] for r in rounds):.1f} | {mb[fmt]:.0f} | "
            f"{ceiling:.0f} | {med / ceiling:.0%} |"
        )


if __name__ == "__main__":
    main()
