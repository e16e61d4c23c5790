"""Time one decode step of the generation engine at 32 sequences, in process.

    python -m bench.llm_step [--rounds 3] [--steps 20]

Builds the engine on the example SmolLM2-135M (examples/build_llm.py) once per setting,
fills it with 32 sequences of random prompts (30..185 tokens) and times decode steps:
rtserve's CPU path (``cpu_fused: true``: fused kernels, oneDNN-packed linears, the screened
greedy head) against ``cpu_fused: false`` (the architecture's own modules, oneDNN-packed
linears). Settings alternate round by round; every round is printed, the medians compared.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from rtserve.llm.detok import Detokenizer
from rtserve.llm.engine import LlmEngine
from rtserve.llm.options import LlmOptions
from rtserve.llm.params import SamplingParams
from rtserve.llm.scheduler import Sequence

VERSION_DIR = Path(__file__).resolve().parent.parent / "examples/llm-repository/smollm2/1"
SETTINGS = {"fused": {"cpu_fused": True}, "plain": {"cpu_fused": False}}


def engine(options: dict[str, object], seqs: int) -> LlmEngine:
    opts = {"device": "cpu", "kv_cache_bytes": 512 << 20, "block_size": 8, **options}
    e = LlmEngine("smollm2", "1", VERSION_DIR, LlmOptions.parse(opts, "bench"))
    e.warmup()
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        n = 30 + 5 * i
        prompt = rng.integers(0, e.runner.vocab_size, size=n).tolist()
        detok = Detokenizer(e.tokenizer, ())
        e.scheduler.add(Sequence(tokens=prompt, num_prompt=n, params=greedy, max_len=n + 400,
                                 detok=detok))  # fmt: skip
    while e.scheduler.waiting or any(s.prefilling for s in e.scheduler.running):
        e._step()
    return e


def time_steps(e: LlmEngine, steps: int) -> float:
    """Mean ms per decode step over ``steps`` steps (after 3 untimed)."""
    for _ in range(3):
        e._step()
    start = time.perf_counter()
    for _ in range(steps):
        e._step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seqs", type=int, default=32)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            e = engine(SETTINGS[name], args.seqs)  # fresh contexts each round: same lengths
            times[name].append(time_steps(e, args.steps))
            print(f"round {r + 1} {name}: {times[name][-1]:.1f} ms per step", flush=True)
            del e
    for name, values in times.items():
        rounds = " / ".join(f"{v:.1f}" for v in values)
        print(f"{name}: median {statistics.median(values):.1f} ms ({rounds})")


if __name__ == "__main__":
    main()
