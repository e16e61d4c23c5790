"""``python -m bench <suite> [options]``: every benchmark of the project by name.

A suite is data: the module that measures it and the argument lists of its runs (several
runs for a sweep). Options after the suite's name replace the recorded ones (one run);
``python -m bench <suite> --help`` shows them. ``python -m bench`` lists the suites.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Suite:
    module: str
    runs: tuple[tuple[str, ...], ...]
    what: str


_SLO = ("--loads", "0.2,0.5,1,1.5,2,3", "--clients", "1")
SUITES = {
    "quick": Suite("bench.run", (("--quick",),), "~4 min: MLP over HTTP, rtserve vs the ASGI floors and FastAPI -> docs/benchmarks-quick.md"),
    "serving": Suite("bench.run", ((),), "~30 min: every peer, both workloads, every client -> docs/benchmarks.md"),
    "cache": Suite("bench.cache_zipf", (("--model", "all"),), "the response cache under a Zipf key mix"),
    "tabular": Suite("bench.tabular", (
        ("--rounds", "3", "--seconds", "3", "--direct-ab", "--workers-ab"),
        ("--rounds", "3", "--seconds", "3", "--pin", "--out", "bench/results/tabular-pinned.json"),
    ), "~20 min: trees (XGBoost, LightGBM) vs MLServer and FastAPI, shared and pinned CPUs -> bench/results/tabular*.json"),
    "slo": Suite("bench.slo_openloop", (
        ("--workload", "minilm", "--seq", "32", "--objective-ms", "250", *_SLO, "--windows", "0,2000,10000",
         "--triton-windows", "0,5000", "--seconds", "6", "--probe-rate", "1500", "--out", "bench/results/slo/minilm-seq32.md"),
        ("--workload", "minilm", "--seq", "128", "--objective-ms", "500", *_SLO, "--windows", "0,2000,10000",
         "--triton-windows", "0,5000", "--seconds", "8", "--probe-rate", "500", "--out", "bench/results/slo/minilm-seq128.md"),
        ("--workload", "mlp", "--objective-ms", "10", *_SLO, "--windows", "0,200,1000", "--triton-windows", "0,5000",
         "--seconds", "4", "--probe-rate", "30000", "--out", "bench/results/slo/mlp.md"),
        ("--workload", "mlp", "--objective-ms", "10", "--loadgen", "c", "--server-cpus", "0", "--client-cpus", "1",
         *_SLO, "--windows", "0,200,1000,5000", "--seconds", "4", "--out", "bench/results/slo/mlp-pinned.md"),
    ), "~25 min: the SLO controller vs fixed windows and Triton, open loop -> bench/results/slo/"),
    "generative": Suite("bench.generative", ((),), "~1-2 h: rtserve (each llm.weights, prompt lookup) vs vLLM-CPU, llama.cpp, transformers -> docs/benchmarks-generative.md"),
    "openai": Suite("bench.openai_features", ((),), "~8 min: a JSON schema vs unconstrained on SmolLM2 (32 streams), /v1/embeddings vs V2 -> docs/benchmarks-generative.md"),
    "soak": Suite("bench.soak", (("--minutes", "30", "--out", "docs/soak.md", "--plot", "docs/img/soak.png"),), "30 min at ~70% of capacity beside hostile clients -> docs/soak.md"),
    "optimize": Suite("bench.showcase.report", (("--out", "docs/optimization.md"),), "the optimizer on MiniLM, EfficientNet, digits -> docs/optimization.md"),
}  # fmt: skip


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SUITES:
        print(__doc__.strip(), "\n\nsuites:")
        for name, suite in SUITES.items():
            print(f"  {name:<11} {suite.what}")
        return 0 if not argv else 2
    suite = SUITES[argv[0]]
    runs = [tuple(argv[1:])] if argv[1:] else suite.runs
    entry = importlib.import_module(suite.module).main
    for run in runs:
        print(f"$ python -m {suite.module} {' '.join(run)}", flush=True)
        code = entry(list(run))
        if code:
            return int(code)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
