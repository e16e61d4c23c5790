"""``rtserve optimize-llm``: the weight formats (and prompt-lookup speculation) of a
``backend: llm`` model, measured on this machine and chosen under a quality budget.

For each variant (``llm.weights`` fp32 / bf16 / int8 / int4, and ``+lookup``: the same
weights with ``llm.speculative: {method: prompt_lookup}``), in one process:

- speed, through rtserve's own engine (the server's, without HTTP): output tok/s at 1, 8
  and 32 concurrent streams of greedy chat answers (``ignore_eos``), time to first token,
  and the resident memory the engine added at load (weights, KV cache, kernels); the
  variants take turns in alternating rounds, as ``rtserve optimize`` times ONNX variants;
- quality against the FP32 model (``rtserve.runtime.llm.quality``): next-token top-1 agreement and
  mean KL under teacher forcing on held-out natural text already on disk, perplexity, and
  greedy agreement over the first 32 tokens of chat prompts. A ``+lookup`` variant has
  its weights' quality: greedy speculative output is the plain greedy output.

The chooser is ``rtserve optimize``'s (``report.choose``): the fastest at one stream within
the budget (top-1 agreement drop and perplexity increase), kept at FP32 when its speed-up
is inside the run's noise band. The choice is written as a model directory whose
``config.yaml`` is the source's with the chosen ``llm.weights`` (and ``llm.speculative``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from rtserve.optimize.errors import OptimizeError
from rtserve.optimize.evaluate import Measurement
from rtserve.optimize.report import choice_note, choose, noise_band, speedup

FORMATS = ("fp32", "bf16", "int8", "int4")
LOOKUP = "+lookup"
BASELINE = "fp32"


@dataclass
class LlmOptimizeOptions:
    weights: tuple[str, ...] = FORMATS
    speculative: tuple[str, ...] = ("int8",)  # weights that also get a +lookup variant
    streams: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 128  # new tokens per answer in the speed rounds
    rounds: int = 3
    positions: int = 1200  # teacher-forced positions
    length: int = 256
    prompts: int = 200  # chat prompts for greedy agreement
    new_tokens: int = 32
    max_top1_drop: float = 0.025
    max_ppl_increase: float = 0.02
    noise_band: float = 0.2
    threads: int = 0
    kv_cache_bytes: int = 256 << 20

    @classmethod
    def quick(cls, **changes: Any) -> LlmOptimizeOptions:
        """Small counts: a run of seconds on a random-weight test model."""
        base = cls(max_tokens=8, rounds=2, positions=96, length=48, prompts=6, new_tokens=8,
                   kv_cache_bytes=16 << 20)  # fmt: skip
        return replace(base, **changes)

    def variants(self) -> list[str]:
        return [*self.weights, *(w + LOOKUP for w in self.speculative if w in self.weights)]


@dataclass
class Speed:
    tok_s: dict[int, list[float]] = field(default_factory=dict)  # streams -> per round
    ttft_ms: dict[int, list[float]] = field(default_factory=dict)  # streams -> all requests
    itl_ms: list[float] = field(default_factory=list)  # gaps between tokens at 1 stream
    resident_mb: float = math.nan
    weight_bytes: int = 0


def _rss_mb() -> float:
    """Resident MB, after returning freed heap to the system (a load's transient FP32 copy
    would otherwise count)."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return math.nan


def source_llm_section(version_dir: pathlib.Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the whole config, its ``llm:`` mapping) of the model directory above ``version_dir``
    (empty when there is no config.yaml)."""
    import yaml

    path = version_dir.parent / "config.yaml"
    if not path.is_file():
        return {"backend": "llm"}, {}
    config = yaml.safe_load(path.read_text()) or {}
    if config.get("backend") != "llm":
        raise OptimizeError(f"{path}: backend: expected llm, got {config.get('backend')!r}")
    return config, dict(config.get("llm") or {})


def variant_llm(base: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``llm:`` mapping of variant ``name`` (``int8``, ``int8+lookup``)."""
    llm = dict(base)
    llm.pop("speculative", None)
    weights = name.removesuffix(LOOKUP)
    llm["weights"] = weights
    if name.endswith(LOOKUP):
        llm["speculative"] = {"method": "prompt_lookup", "num_tokens": 4, "max_batch": 4}
    return llm


def _engine(version_dir: pathlib.Path, name: str, base: dict[str, Any],
            options: LlmOptimizeOptions) -> Any:  # fmt: skip
    from rtserve.errors import ConfigError
    from rtserve.runtime.llm.engine import LlmEngine
    from rtserve.runtime.llm.options import LlmOptions

    llm = variant_llm(base, name)
    llm.update(device="cpu", threads=options.threads, kv_cache_bytes=options.kv_cache_bytes)
    llm["max_num_seqs"] = max(int(llm.get("max_num_seqs", 64)), max(options.streams))
    try:
        parsed = LlmOptions.parse(llm, f"{version_dir.parent / 'config.yaml'}")
        engine = LlmEngine("optimize", "1", version_dir, parsed)
    except ConfigError as exc:
        raise OptimizeError(str(exc)) from None
    engine.warmup(prompt_len=32, new_tokens=4, seqs=2)
    engine.start()
    return engine


def weight_bytes(version_dir: pathlib.Path, weights: str) -> int:
    """Bytes of linear weights a decode step reads under ``weights`` (the head included, in
    the format ``quant.plan`` gives each layer), counted on a weightless copy of the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rtserve.runtime.llm import quant

    config = AutoConfig.from_pretrained(version_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    formats = quant.plan(model, weights) if weights != "fp32" else {}
    total = 0.0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * quant.BYTES_PER_WEIGHT[formats.get(name, "fp32")]
    return int(total)


async def _stream(engine: Any, ids: list[int], params: Any, ttft: list[float],
                  gaps: list[float] | None) -> int:  # fmt: skip
    start = time.perf_counter()
    last = start
    n = 0
    async for event in engine.generate(ids, params):
        now = time.perf_counter()
        if event.token_ids:
            if n == 0:
                ttft.append((now - start) * 1e3)
            elif gaps is not None:
                gaps.append((now - last) * 1e3 / len(event.token_ids))
            last = now
            n += len(event.token_ids)
    return n


async def _round(engine: Any, prompts: list[list[int]], streams: int, max_tokens: int,
                 speed: Speed) -> None:  # fmt: skip
    """``streams`` requests at once (at 1 stream: 2 in turn); output tok/s of the round."""
    from rtserve.runtime.llm.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft = speed.ttft_ms.setdefault(streams, [])
    start = time.perf_counter()
    if streams == 1:
        tokens = 0
        for ids in prompts[:2]:
            tokens += await _stream(engine, ids, params, ttft, speed.itl_ms)
    else:
        chosen = [prompts[i % len(prompts)] for i in range(streams)]
        counts = await asyncio.gather(*(_stream(engine, ids, params, ttft, None) for ids in chosen))
        tokens = sum(counts)
    speed.tok_s.setdefault(streams, []).append(tokens / (time.perf_counter() - start))


def measure_speed(version_dir: pathlib.Path, options: LlmOptimizeOptions, progress: bool = True,
                  skipped: dict[str, str] | None = None) -> dict[str, Speed]:  # fmt: skip
    """Every variant's engine built once; rounds alternate between them. A variant whose
    engine cannot be built is left out, the reason in ``skipped``."""
    import gc

    from rtserve.runtime.llm import quality

    _, base = source_llm_section(version_dir)
    engines: dict[str, Any] = {}
    speeds: dict[str, Speed] = {}
    try:
        for name in options.variants():
            gc.collect()
            before = _rss_mb()
            try:
                engines[name] = _engine(version_dir, name, base, options)
            except OptimizeError:
                raise
            except Exception as exc:
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                if skipped is not None:
                    skipped[name] = why
                if progress:
                    print(f"{name}: not built: {why}", flush=True)
                continue
            speeds[name] = Speed(resident_mb=max(0.0, _rss_mb() - before),
                                 weight_bytes=weight_bytes(version_dir, name.removesuffix(LOOKUP)))  # fmt: skip
            if progress:
                print(f"loaded {name}: {speeds[name].resident_mb:.0f} MB resident", flush=True)
        if not engines:
            return speeds
        first = next(iter(engines.values()))
        # A different chat per stream (a shared prefix would be served from the cache).
        chats = quality.chat_prompts(max(options.streams) + 2, seed=1)
        prompts = [first.encode_messages(m) for m in chats]

        async def run_all() -> None:
            for r in range(options.rounds):
                for name, engine in engines.items():
                    for streams in options.streams:
                        await _round(engine, prompts, streams, options.max_tokens, speeds[name])
                    if progress:
                        s = speeds[name].tok_s
                        print(f"round {r + 1} {name}: "
                              + ", ".join(f"{k} streams {v[-1]:.0f} tok/s" for k, v in s.items()),
                              flush=True)  # fmt: skip
            for engine in engines.values():
                await engine.stop()

        asyncio.run(run_all())
    finally:
        engines.clear()
    return speeds


def measure_quality(version_dir: pathlib.Path, options: LlmOptimizeOptions,
                    built: set[str]) -> dict[str, Any]:  # fmt: skip
    """``quality.Quality`` of each weight format in ``built`` (FP32 against itself is
    exact)."""
    from rtserve.runtime.llm import quality

    formats = [w for w in options.weights if w != BASELINE and w in built]
    rows = quality.evaluate(version_dir, formats, options.positions, options.length,
                            options.prompts, options.new_tokens, options.threads)  # fmt: skip
    out: dict[str, Any] = {q.weights: q for q in rows}
    if BASELINE in options.weights:
        ref = rows[0] if rows else None
        if ref is None:  # (FP32 alone: its perplexity still counts)
            ref = quality.evaluate(version_dir, [BASELINE], options.positions, options.length,
                                   0, options.new_tokens, options.threads)[0]  # fmt: skip
        ppl = ref.ppl_fp32 if ref else math.nan
        positions = ref.positions if ref else 0
        out[BASELINE] = quality.Quality(BASELINE, positions, 1.0, 0.0, ppl, ppl, 1.0, 1.0,
                                        options.prompts, options.new_tokens)  # fmt: skip
    return out


def measurements(speeds: dict[str, Speed], qualities: dict[str, Any],
                 options: LlmOptimizeOptions) -> list[Measurement]:  # fmt: skip
    """One ``Measurement`` per variant, in the chooser's terms: "p50 at batch 1" is the
    milliseconds per output token at one stream, "rows/s at batch N" output tok/s at N
    streams, the score next-token top-1 agreement with FP32."""
    out = []
    for name, s in speeds.items():
        q = qualities[name.removesuffix(LOOKUP)]
        m = Measurement(name, name, s.weight_bytes, peak_mem_mb=s.resident_mb)
        one = s.tok_s.get(1) or s.tok_s[min(s.tok_s)]
        m.round_p50_ms = [1e3 / t for t in one]
        m.p50_ms = min(m.round_p50_ms)
        m.p99_ms = float(_pct(s.itl_ms, 99)) if s.itl_ms else math.nan
        m.throughput = {k: max(v) for k, v in s.tok_s.items()}
        m.round_throughput = {k: list(v) for k, v in s.tok_s.items()}
        m.score, m.score_name = q.top1, "top1_agreement"
        m.metrics = {
            "top1_agreement": q.top1, "kl": q.kl, "ppl": q.ppl, "ppl_fp32": q.ppl_fp32,
            "ppl_change": q.ppl_change, "greedy_prefix": q.greedy_prefix,
            "greedy_exact": q.greedy_exact,
            **{f"ttft_p50_ms_{k}": statistics.median(v) for k, v in s.ttft_ms.items() if v},
        }  # fmt: skip
        if name.endswith(LOOKUP):
            m.notes.append(f"quality of {name.removesuffix(LOOKUP)} (greedy output identical)")
        if q.ppl_change > options.max_ppl_increase:
            m.notes.append(f"perplexity {100 * q.ppl_change:+.1f}% over budget")
        out.append(m)
    return out


def _pct(values: list[float], p: float) -> float:
    import numpy as np

    return float(np.percentile(values, p))


def in_budget(m: Measurement, options: LlmOptimizeOptions) -> bool:
    return (
        not math.isnan(m.score)
        and 1.0 - m.score <= options.max_top1_drop + 1e-12
        and m.metrics.get("ppl_change", math.inf) <= options.max_ppl_increase + 1e-12
    )


@dataclass
class LlmResult:
    measurements: list[Measurement]
    chosen: Measurement | None
    noise: float
    note: str
    options: LlmOptimizeOptions
    skipped: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        o = self.options
        ms = self.measurements
        base = next((m for m in ms if m.name == BASELINE), None)
        head = (
            ["variant", "weights read / token"]
            + [f"tok/s {k} stream{'s' if k > 1 else ''}" for k in o.streams]
            + ["TTFT p50 ms (1 stream)", "resident MB", "top-1 agreement", "mean KL",
               "perplexity (change)", f"greedy prefix / exact ({o.new_tokens} tok)",
               "speed-up 1 stream", "in budget", "notes"]
        )  # fmt: skip
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for m in ms:
            k = m.metrics
            speed = speedup(base, m, 1) if base is not None and 1 in m.throughput else math.nan
            flags = ["**chosen**"] if self.chosen is not None and m.name == self.chosen.name else []
            row = (
                [f"`{m.name}`", f"{m.size_bytes / 1e6:.1f} MB"]
                + [f"{m.throughput.get(s, math.nan):.0f}" for s in o.streams]
                + [
                    f"{k.get('ttft_p50_ms_1', math.nan):.0f}", f"{m.peak_mem_mb:.0f}",
                    f"{m.score:.3f}", f"{k['kl']:.4f}",
                    f"{k['ppl']:.3f} ({100 * k['ppl_change']:+.2f}%)",
                    f"{k['greedy_prefix']:.3f} / {k['greedy_exact']:.2f}",
                    f"{speed:.2f}x", "yes" if in_budget(m, o) else "no",
                    "; ".join(flags + m.notes),
                ]
            )  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
        text = "\n".join(lines) + "\n"
        text += (
            f"\nBudget: top-1 agreement >= {1 - o.max_top1_drop:.3f} and perplexity within "
            f"{100 * o.max_ppl_increase:+.1f}% of FP32; noise band +-{self.noise:.0%}. "
            f"Speed: {o.rounds} alternating rounds, {o.max_tokens} new tokens per answer, "
            "greedy, the best round's tok/s shown, speed-ups the median of round-by-round "
            "ratios.\n"
        )
        if self.note:
            text += f"\n{self.note}\n"
        for name, why in self.skipped.items():
            text += f"\n- `{name}` not measured: its engine could not be built: {why}"
        return text + ("\n" if self.skipped else "")


def run_llm(version_dir: pathlib.Path, options: LlmOptimizeOptions,
            progress: bool = True) -> LlmResult:  # fmt: skip
    skipped: dict[str, str] = {}
    speeds = measure_speed(version_dir, options, progress, skipped)
    if progress:
        print("quality against FP32 ...", flush=True)
    built = {n.removesuffix(LOOKUP) for n in speeds}
    qualities = measure_quality(version_dir, options, built) if speeds else {}
    ms = measurements(speeds, qualities, options)
    base = next((m for m in ms if m.name == BASELINE), None)
    noise = noise_band(base, options.noise_band)
    ok = [m for m in ms if in_budget(m, options)]
    baseline = BASELINE if base is not None else None
    chosen = choose(ok, 1.0, options.max_top1_drop, baseline, noise)
    note = choice_note(ok, 1.0, options.max_top1_drop, BASELINE, noise) if baseline else ""
    return LlmResult(ms, chosen, noise, note, options, skipped)


def _place(src: pathlib.Path, dst: pathlib.Path) -> None:
    """A hard link where the file system allows it (weights are large), else a copy."""
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def publish_llm(out: pathlib.Path, version_dir: pathlib.Path, result: LlmResult) -> pathlib.Path:
    """``out/config.yaml`` (the source's, with the chosen ``llm.weights`` / speculative),
    ``out/1/`` (the checkpoint's files) and ``out/optimization.json``."""
    import yaml

    assert result.chosen is not None
    if not out.name or out.name in (".", ".."):
        raise OptimizeError(f"--out must be REPO/NAME, got {out}")
    config, base = source_llm_section(version_dir)
    config = dict(config)
    config["llm"] = variant_llm(base, result.chosen.name)
    version = out / "1"
    version.mkdir(parents=True, exist_ok=True)
    for f in version_dir.iterdir():
        if f.is_file():
            _place(f, version / f.name)
    text = f"# written by rtserve optimize-llm: {result.chosen.name} was chosen\n"
    (out / "config.yaml").write_text(text + yaml.safe_dump(config, sort_keys=False))
    o = result.options
    record = {
        "chosen": result.chosen.name,
        "llm": config["llm"],
        "budget": {"max_top1_drop": o.max_top1_drop, "max_ppl_increase": o.max_ppl_increase},
        "noise_band": result.noise,
        "rule": "fastest at one stream within the quality budget, beyond the noise band",
        "measurements": [m.as_dict() for m in result.measurements],
    }
    (out / "optimization.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return out / "config.yaml"


def _names(text: str, flag: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip()) if text else ()
    bad = [n for n in names if n not in allowed]
    if bad:
        raise OptimizeError(f"{flag}: unknown {bad[0]!r}; choose from {', '.join(allowed)}")
    return names


def options_from_args(args: argparse.Namespace) -> LlmOptimizeOptions:
    from rtserve.optimize.args import number

    number(args, "max_top1_drop", 0.0, 1.0, False)
    number(args, "max_ppl_increase", 0.0, math.inf, False)
    number(args, "noise_band", 0.0, 10.0, False)
    weights = _names(args.weights, "--weights", FORMATS)
    if not weights:
        raise OptimizeError("--weights: expected at least one of " + ", ".join(FORMATS))
    speculative = _names(args.speculative, "--speculative", FORMATS)
    missing = [w for w in speculative if w not in weights]
    if missing:
        raise OptimizeError(f"--speculative {missing[0]}: not among --weights {args.weights}")
    try:
        streams = tuple(int(s) for s in args.streams.split(","))
    except ValueError:
        raise OptimizeError(
            f"--streams: expected a comma list of integers, got {args.streams!r}"
        ) from None
    if not streams or min(streams) < 1 or max(streams) > 256:
        raise OptimizeError(f"--streams: expected integers in [1, 256], got {args.streams!r}")
    counts = {"max_tokens": 1, "rounds": 1, "positions": 8, "length": 8, "prompts": 0,
              "new_tokens": 1, "threads": 0}  # fmt: skip
    for name, low in counts.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise OptimizeError(
                f"--{name.replace('_', '-')}: expected an integer >= {low}, got {value}"
            )
    given = {n: getattr(args, n) for n in counts if getattr(args, n) is not None}
    common = dict(weights=weights, speculative=speculative, streams=streams,
                  max_top1_drop=args.max_top1_drop, max_ppl_increase=args.max_ppl_increase,
                  noise_band=args.noise_band, **given)  # fmt: skip
    return LlmOptimizeOptions.quick(**common) if args.quick else LlmOptimizeOptions(**common)


def cmd_optimize_llm(args: argparse.Namespace) -> int:
    from rtserve.optimize.args import check_folder

    options = options_from_args(args)
    version_dir = pathlib.Path(args.model)
    if not (version_dir / "config.json").is_file():
        raise OptimizeError(
            f"{version_dir}: expected a model version directory with config.json "
            "(e.g. examples/llm-repository/smollm2/1)"
        )
    out = pathlib.Path(args.out)
    work = (
        pathlib.Path(args.work)
        if args.work
        else pathlib.Path("optimize-out") / (out.resolve().name or "llm")
    )
    check_folder(out, "--out")
    check_folder(work, "--work")
    work.mkdir(parents=True, exist_ok=True)
    source_llm_section(version_dir)  # (a wrong backend is refused before minutes of work)
    result = run_llm(version_dir, options, progress=not args.no_progress)
    table = result.table()
    head = f"{version_dir}: weight formats and speculation against FP32\n\n"
    (work / "report.md").write_text(head + table)
    (work / "report.json").write_text(
        json.dumps([m.as_dict() for m in result.measurements], indent=2, default=str) + "\n"
    )
    print(head + table)
    print(f"report: {work / 'report.md'}")
    if result.chosen is None:
        print("error: no variant stays within the quality budget; nothing written", file=sys.stderr)
        return 1
    config = publish_llm(out, version_dir, result)
    print(f"chose {result.chosen.name}: wrote {config} and {out / '1'}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``optimize-llm`` to an argparse subparsers action."""
    from rtserve.optimize.args import guard

    p = subparsers.add_parser(
        "optimize-llm",
        help="measure an LLM's weight formats and speculation; write the fastest in budget",
        description="Build each llm.weights format (fp32, bf16, int8, int4) and prompt-lookup "
        "speculation of a backend: llm model, measure tok/s at 1, 8 and 32 streams, TTFT, "
        "resident memory and quality against FP32 on this machine, and write the fastest "
        "within the quality budget as a model directory.",
    )
    p.add_argument("model", help="the model's version directory (config.json, weights, tokenizer)")
    p.add_argument(
        "--out", required=True, help="REPO/NAME: where the chosen variant is written (required)"
    )
    p.add_argument("--work", help="folder for the report (default: optimize-out/NAME)")
    p.add_argument("--weights", default=",".join(FORMATS),
                   help="comma list of weight formats (default: %(default)s)")  # fmt: skip
    p.add_argument("--speculative", default="int8",
                   help="weight formats that also get a prompt-lookup variant, comma list, "
                   "'' for none (default: %(default)s)")  # fmt: skip
    p.add_argument("--max-top1-drop", type=float, default=0.025,
                   help="budget: next-token top-1 agreement with FP32 may fall by this much "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--max-ppl-increase", type=float, default=0.02,
                   help="budget: perplexity may rise by this fraction (default: %(default)s)")  # fmt: skip
    p.add_argument("--noise-band", type=float, default=0.2,
                   help="a variant must beat FP32 at one stream by more than this fraction "
                   "(or the run's own spread) (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--streams", default="1,8,32", help="concurrent streams timed (default: %(default)s)"
    )
    p.add_argument("--quick", action="store_true",
                   help="small counts (8 new tokens, 2 rounds, 96 positions, 6 prompts): a "
                   "check of the pipeline, not a measurement (default: off)")  # fmt: skip
    for name, default, what in (
        ("max-tokens", 128, "new tokens per answer in the speed rounds"),
        ("rounds", 3, "alternating speed rounds"),
        ("positions", 1200, "teacher-forced positions of held-out text"),
        ("length", 256, "tokens per teacher-forced chunk"),
        ("prompts", 200, "chat prompts for greedy agreement"),
        ("new-tokens", 32, "greedy tokens compared per prompt"),
        ("threads", 0, "torch threads (0: the CPUs this process may use)"),
    ):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{what} (default: {default}; with --quick smaller)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress lines (default: shown)")
    p.set_defaults(func=guard(cmd_optimize_llm))


def main(argv: list[str] | None = None) -> int:
    from rtserve.optimize.args import run_command

    return run_command(register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
