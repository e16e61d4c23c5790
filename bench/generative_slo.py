"""The first-token objective past saturation: rtserve with ``slo: {ttft_p99_ms}`` against
rtserve without it and vLLM-CPU (which only queues), Poisson arrivals at one rate.

For each server: requests admitted and refused, the admitted requests' TTFT p50 / p99, how
fast a refusal (429) comes back, and output tokens/s. Servers run one at a time under
``flock /tmp/bench.lock``, in alternating order over rounds.

    python -m bench.generative_slo --rate 4 --objective-ms 1000 --out bench/results/generative-slo.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench import generative as gen
from bench import procs
from bench.clients.sse import Stream, _apply, chat_body, closed_loop
from bench.stats import percentile

ROOT = Path(__file__).resolve().parents[1]


def objective_repository(work: Path, objective_ms: float) -> Path:
    """A repository whose smollm2 is the example's weights with a first-token objective."""
    source = ROOT / "examples" / "llm-repository" / gen.MODEL
    repo = work / "slo-repository"
    model = repo / gen.MODEL
    model.mkdir(parents=True, exist_ok=True)
    link = model / "1"
    if not link.exists():
        link.symlink_to((source / "1").resolve())
    config = yaml.safe_load((source / "config.yaml").read_text())
    config["slo"] = {"ttft_p99_ms": objective_ms}
    (model / "config.yaml").write_text(yaml.safe_dump(config))
    return repo


async def one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[Stream, float]:
    """The streamed answer, and when the status line came back (the refusal time)."""
    stream = Stream(sent=time.perf_counter())
    async with session.post(url, data=orjson.dumps(body)) as resp:
        status_at = time.perf_counter()
        if resp.status != 200:
            body = await resp.read()
            stream.error = (
                "HTTP 429" if resp.status == 429 else f"HTTP {resp.status}: {body[:160]!r}"
            )
            return stream, status_at
        async for raw in resp.content:
            now = time.perf_counter()
            line = raw.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                _apply(orjson.loads(line[5:].strip()), stream, now)
    return stream, status_at


async def poisson(url: str, rate: float, seconds: float, max_tokens: int) -> dict[str, Any]:
    rng = random.Random(1)
    n = round(rate * seconds)
    bodies = [chat_body(gen.MODEL, gen.story(i), max_tokens) for i in range(n)]
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=900), headers={"Content-Type": "application/json"}
    ) as session:
        start = at = time.perf_counter()
        tasks = []
        for body in bodies:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, url, body)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    admitted = [s for s, _ in results if s.error is None and s.chunks]
    refused = [t - s.sent for s, t in results if s.error == "HTTP 429"]
    ttfts = [s.ttft for s in admitted if s.ttft is not None]
    row: dict[str, Any] = {
        "rate": rate,
        "requests": n,
        "admitted": len(admitted),
        "refused_429": len(refused),
        "other_errors": n - len(admitted) - len(refused),
        "other_kinds": sorted(
            {s.error or f"200 with {len(s.chunks)} chunks" for s, _ in results}
            - {None, "HTTP 429"}
            - {f"200 with {len(s.chunks)} chunks" for s in admitted}
        ),
        "tok_s": round(sum(s.tokens for s in admitted) / wall, 1),
    }
    if ttfts:
        row["ttft_p50_ms"] = gen._ms(percentile(ttfts, 50))
        row["ttft_p99_ms"] = gen._ms(percentile(ttfts, 99))
        row["ttft_max_ms"] = gen._ms(max(ttfts))
        row["ttft_ms"] = sorted(gen._ms(t) for t in ttfts)
    if refused:
        row["refusal_p50_ms"] = gen._ms(percentile(refused, 50))
        row["refusal_p99_ms"] = gen._ms(percentile(refused, 99))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s (about 2x saturation)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--objective-ms", type=float, default=1000.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--servers", default="rtserve-objective,rtserve,vllm")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/generative-slo.json")
    args = ap.parse_args()
    work = ROOT / "bench" / ".work" / "generative-slo"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = ROOT / "examples" / "llm-repository" / gen.MODEL / "1"
    repos = {
        "rtserve-objective": objective_repository(work, args.objective_ms),
        "rtserve": ROOT / "examples" / "llm-repository",
    }
    names = args.servers.split(",")
    rounds = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else list(reversed(names))
        row: dict[str, Any] = {}
        for name in order:
            port = procs.free_port()
            base = f"http://127.0.0.1:{port}"
            with gen.bench_lock():
                if name == "vllm":
                    server = gen.start_vllm(work, port, model_dir, "auto")
                else:
                    server = gen.start_rtserve(work, port, repos[name])
                try:
                    ready = "/v1/models" if name == "vllm" else "/v2/health/ready"
                    server.wait_ready(base + ready, timeout_s=600)
                    url = f"{base}/v1/chat/completions"
                    warm = [chat_body(gen.MODEL, gen.story(i), 16) for i in range(8)]
                    asyncio.run(closed_loop(url, warm, 8))
                    row[name] = asyncio.run(poisson(url, args.rate, args.seconds, args.max_tokens))
                finally:
                    server.stop()
            print(f"round {r + 1} {name}: {json.dumps(row[name])}", flush=True)
        rounds.append(row)
    result = {
        "command": "python -m bench.generative_slo "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "objective_ms": args.objective_ms,
        "max_tokens": args.max_tokens,
        "rounds": rounds,
    }
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
