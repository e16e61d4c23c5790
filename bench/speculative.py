"""Speculative decoding (``llm.speculative``) through the server, on SmolLM2-135M-Instruct.

Targets (one server each, started in alternating order over rounds, under the bench lock):
  plain      the example's config (no speculation)
  lookup     + ``speculative: {method: prompt_lookup, num_tokens: K, max_batch: 4}``
  always     + the same with ``max_batch: 64`` (speculating at every batch size: where the
             crossover is)
Workloads (streaming chat, greedy, ``max_tokens`` new tokens, the same client as
``bench/generative.py``):
  summarize  a ~1,000-token document (sentences of examples/data/sentences.txt) and
             "Summarize it." at 1 stream (2 requests) and 4 streams (4 requests), ignore_eos
  stories    "Write a short story number i about a cat." at 32 streams (32 requests,
             ignore_eos)

    python -m bench.speculative --rounds 2 --out bench/results/speculative.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import yaml

from bench import machine, procs
from bench.clients.sse import Messages, chat_body, closed_loop
from bench.generative import LLM_REPO, MODEL, ROOT, bench_lock, start_rtserve, story, summarize

DOC_TOKENS = 1000


def document(model_dir: Path, tokens: int = DOC_TOKENS) -> str:
    """Sentences of examples/data/sentences.txt, in order, up to about ``tokens`` tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lines = (ROOT / "examples" / "data" / "sentences.txt").read_text().splitlines()
    text = ""
    for line in lines:
        if len(tokenizer.encode(text + " " + line).ids) > tokens:
            break
        text = f"{text} {line}".strip()
    return text


def summarize_messages(doc: str, i: int) -> Messages:
    # (a different first line per request: the answers are not prefix-cache replays)
    return [{"role": "user", "content": f"Document {i}:\n{doc}\n\nSummarize it."}]


def repository(work: Path, name: str, speculative: dict[str, Any] | None, threads: int) -> Path:
    """A repository with the example SmolLM2 (its version directory linked) and its config,
    plus ``speculative`` when given."""
    repo = work / name
    model = repo / MODEL
    model.mkdir(parents=True, exist_ok=True)
    link = model / "1"
    if not link.exists():
        link.symlink_to(LLM_REPO / MODEL / "1")
    config = yaml.safe_load((LLM_REPO / MODEL / "config.yaml").read_text())
    if threads:
        config["llm"]["threads"] = threads
    if speculative is not None:
        config["llm"]["speculative"] = speculative
    (model / "config.yaml").write_text(yaml.safe_dump(config))
    return repo


def measure(repo: Path, work: Path, doc: str, max_tokens: int) -> dict[str, Any]:
    port = procs.free_port()
    base = f"http://127.0.0.1:{port}"
    url = f"{base}/v1/chat/completions"
    with bench_lock():
        server = start_rtserve(work, port, repo)
        try:
            server.wait_ready(f"{base}/v2/health/ready", timeout_s=600)
            warm = [chat_body(MODEL, summarize_messages(doc, 900 + i), 16) for i in range(2)]
            asyncio.run(closed_loop(url, warm, 2))
            row: dict[str, Any] = {}
            for c in (1, 4):
                bodies = [
                    chat_body(MODEL, summarize_messages(doc, i), max_tokens, ignore_eos=True)
                    for i in range(max(2, c))
                ]
                streams, wall = asyncio.run(closed_loop(url, bodies, c))
                row[f"summarize_{c}"] = summarize(streams, wall)
            bodies = [chat_body(MODEL, story(i), max_tokens) for i in range(32)]
            streams, wall = asyncio.run(closed_loop(url, bodies, 32))
            row["stories_32"] = summarize(streams, wall)
            return row
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-tokens", type=int, default=6, help="K: tokens drafted per step")
    parser.add_argument("--targets", default="plain,lookup,always")
    parser.add_argument(
        "--threads", type=int, default=0,
        help="llm.threads (0: the example's; 1 on a busy box, where OpenMP's waits collapse)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/speculative.json")
    args = parser.parse_args()
    if not (LLM_REPO / MODEL / "1" / "config.json").is_file():
        sys.exit("no SmolLM2 example: run `make examples` first")
    lookup = {"method": "prompt_lookup", "num_tokens": args.num_tokens, "max_batch": 4}
    configs: dict[str, dict[str, Any] | None] = {
        "plain": None,
        "lookup": lookup,
        "always": dict(lookup, max_batch=64),
    }
    names = args.targets.split(",")
    doc = document(LLM_REPO / MODEL / "1")
    results: dict[str, Any] = {
        "machine": machine.summary(),
        "load_before": machine.load_average(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rounds": [],
    }
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        work = Path(tmp)
        repos = {n: repository(work, n, configs[n], args.threads) for n in names}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else list(reversed(names))
            this: dict[str, Any] = {}
            for n in order:
                row = measure(repos[n], work / f"{n}-{r}", doc, args.max_tokens)
                this[n] = row
                cells = ", ".join(f"{k} {v['tok_s']}" for k, v in row.items())
                print(f"round {r + 1} {n}: {cells} tok/s", flush=True)
            results["rounds"].append(this)
    medians: dict[str, dict[str, float]] = {}
    for n in names:
        keys = results["rounds"][0][n].keys()
        medians[n] = {
            k: statistics.median(rnd[n][k]["tok_s"] for rnd in results["rounds"]) for k in keys
        }
    results["medians"] = medians
    for n, row in medians.items():
        print(f"median {n}: {row}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
