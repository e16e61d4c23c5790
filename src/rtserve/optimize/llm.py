"""``rtserve optimize-llm``: the weight formats (and speculative decoding) of a
``backend: llm`` model, measured on this machine and chosen under a quality budget.

For each variant (``llm.weights`` fp32 / bf16 / int8 / int4; ``+lookup``: the same weights
with ``llm.speculative: {method: prompt_lookup}``; ``+draft``: with ``{method: draft}``, a
``--draft`` model drafting), in one process:

- speed, through rtserve's own engine (the server's, without HTTP): output tok/s at 1, 8
  and 32 concurrent streams of greedy chat answers (``ignore_eos``), time to first token,
  and the resident memory the engine added at load (weights, KV cache, kernels); the
  variants take turns in alternating rounds, as ``rtserve optimize`` times ONNX variants;
- quality against the FP32 model (``rtserve.runtime.llm.quality``): next-token top-1 agreement and
  mean KL under teacher forcing on held-out natural text already on disk, perplexity, and
  greedy agreement over the first 32 tokens of chat prompts. A ``+lookup`` or ``+draft``
  variant has its weights' quality: greedy speculative output is the plain greedy output.

A draft is a model directory or a model name of the source's repository with the source's
tokenizer (checked as the engine checks it), optionally ``@FORMAT``, or a bare format
(``int4``): the source itself at that format. The engine finds a draft by name in its
model's repository and loads it in its config.yaml's ``llm.weights``, so each draft is a
repository entry: the variants are timed from ``WORK/draft-repo/`` (the source and each
draft linked there, a draft's config.yaml giving its format), and a chosen ``+draft`` is
written with its draft beside it as ``NAME-draft`` (a served model of its own), unless
the draft, unchanged, already is a model of ``--out``'s repository.

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
DRAFT = "+draft"
BASELINE = "fp32"
STAGED = "source"  # the source's name in WORK/draft-repo/
WRITTEN = "# written by rtserve optimize-llm"


def weights_of(name: str) -> str:
    """The weight format of variant ``name`` (``int8+lookup``: int8)."""
    return name.split("+", 1)[0]


@dataclass(frozen=True)
class Draft:
    """A ``--draft``: ``version_dir`` drafts at ``weights``; its variants are named
    ``<weights>`` + ``suffix`` (``+draft``; ``+draft:<label>`` when there are several)."""

    spec: str
    label: str  # its model name in WORK/draft-repo/
    version_dir: pathlib.Path
    weights: str
    itself: bool = False  # the source model at ``weights``
    as_is: bool = True  # its own directory and config.yaml's weights (no @FORMAT)
    suffix: str = DRAFT


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
    drafts: tuple[Draft, ...] = ()  # each adds a +draft variant of the --speculative weights

    @classmethod
    def quick(cls, **changes: Any) -> LlmOptimizeOptions:
        """Small counts: a run of seconds on a random-weight test model."""
        base = cls(max_tokens=8, rounds=2, positions=96, length=48, prompts=6, new_tokens=8,
                   kv_cache_bytes=16 << 20)  # fmt: skip
        return replace(base, **changes)

    def variants(self) -> list[str]:
        spec = [w for w in self.speculative if w in self.weights]
        drafted = [w + d.suffix for d in self.drafts for w in spec]
        return [*self.weights, *(w + LOOKUP for w in spec), *drafted]

    def draft_of(self, name: str) -> Draft | None:
        """The draft of variant ``name`` (None: not a +draft variant)."""
        return next((d for d in self.drafts if name == weights_of(name) + d.suffix), None)


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


def variant_llm(base: dict[str, Any], name: str, draft_model: str = "") -> dict[str, Any]:
    """The ``llm:`` mapping of variant ``name`` (``int8``, ``int8+lookup``, ``int8+draft``:
    drafted by the repository's model ``draft_model``)."""
    llm = dict(base)
    llm.pop("speculative", None)
    llm["weights"] = weights_of(name)
    if name.endswith(LOOKUP):
        llm["speculative"] = {"method": "prompt_lookup", "num_tokens": 4, "max_batch": 4}
    elif name.startswith(llm["weights"] + DRAFT):
        if not draft_model:
            raise ValueError(f"{name}: a +draft variant needs its draft model's name")
        llm["speculative"] = {"method": "draft", "draft_model": draft_model, "num_tokens": 4,
                              "max_batch": 4}  # fmt: skip
    return llm


def _newest_version(model_dir: pathlib.Path) -> pathlib.Path | None:
    """The version directory the engine takes from a model directory (the highest number
    with a config.json)."""
    if not model_dir.is_dir():
        return None
    versions = sorted(
        (int(d.name), d)
        for d in model_dir.iterdir()
        if d.name.isdigit() and (d / "config.json").is_file()
    )
    return versions[-1][1] if versions else None


def _draft_dir(head: str, spec: str, version_dir: pathlib.Path) -> pathlib.Path:
    """The version directory ``--draft`` ``head`` names: a version or model directory, or a
    model of the source's repository."""
    path = pathlib.Path(head)
    root = version_dir.resolve().parent.parent
    if not path.is_dir():
        if "/" in head or head in ("", ".", "..") or not (root / head).is_dir():
            raise OptimizeError(
                f"--draft {spec}: no directory {head!r} and no model {head!r} in the source's "
                f"repository {root}"
            )
        path = root / head
    if (path / "config.json").is_file():
        return path
    newest = _newest_version(path)
    if newest is None:
        raise OptimizeError(
            f"--draft {spec}: {path} has no config.json and no <version>/config.json "
            "(expected a model version directory or a model directory)"
        )
    return newest


def resolve_drafts(version_dir: pathlib.Path, specs: tuple[str, ...]) -> tuple[Draft, ...]:
    """The ``--draft`` specs (``DIR_OR_NAME[@FORMAT]``, or a bare FORMAT: the source at it),
    each checked as the engine checks a draft model (it loads, the source's tokenizer, no
    larger vocabulary); errors name ``--draft``."""
    from rtserve.errors import ConfigError
    from rtserve.runtime.llm.speculative import check_draft

    tokenizer: Any = None
    vocab = 0
    out: list[Draft] = []
    labels = {STAGED}
    for spec in specs:
        head, at, fmt = spec.rpartition("@")
        if not at:
            head, fmt = spec, ""
        elif fmt not in FORMATS:
            raise OptimizeError(
                f"--draft {spec}: unknown weight format {fmt!r}; choose from {', '.join(FORMATS)}"
            )
        if not at and spec in FORMATS:
            draft = Draft(spec, spec, version_dir, spec, itself=True, as_is=False)
        else:
            draft_dir = _draft_dir(head, spec, version_dir)
            try:
                _, own = source_llm_section(draft_dir)
            except OptimizeError as exc:
                raise OptimizeError(f"--draft {spec}: {exc}") from None
            weights = fmt or str(own.get("weights", "fp32"))
            if weights not in FORMATS:
                raise OptimizeError(
                    f"--draft {spec}: {draft_dir.parent / 'config.yaml'}: llm.weights "
                    f"{weights!r} is not one of {', '.join(FORMATS)}"
                )
            if tokenizer is None:
                from transformers import AutoConfig, AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(version_dir)
                vocab = int(AutoConfig.from_pretrained(version_dir).vocab_size)
            try:
                check_draft(draft_dir, tokenizer, vocab, f"--draft {spec}", head)
            except ConfigError as exc:
                raise OptimizeError(str(exc)) from None
            model = draft_dir.parent.name if draft_dir.name.isdigit() else draft_dir.name
            label = model + (f"-{fmt}" if fmt else "")
            draft = Draft(spec, label, draft_dir, weights, as_is=not fmt)
        label, n = draft.label, 2
        while label in labels:
            label, n = f"{draft.label}-{n}", n + 1
        labels.add(label)
        out.append(replace(draft, label=label))
    if len(out) > 1:
        out = [replace(d, suffix=f"{DRAFT}:{d.label}") for d in out]
    return tuple(out)


def draft_config(draft: Draft) -> dict[str, Any]:
    """The config.yaml of ``draft``'s repository entry: its own (the source's when it
    drafts for itself) at its weights, without speculation."""
    config, llm = source_llm_section(draft.version_dir)
    llm.pop("speculative", None)
    llm["weights"] = draft.weights
    return {**config, "backend": "llm", "llm": llm}


def stage_drafts(root: pathlib.Path, version_dir: pathlib.Path,
                 drafts: tuple[Draft, ...]) -> pathlib.Path:  # fmt: skip
    """``root/source/1/`` and ``root/<label>/1/`` per draft (the files linked, each draft's
    ``draft_config``): a repository where the engine finds the drafts by name. The source's
    version directory there."""
    import yaml

    if root.exists():
        shutil.rmtree(root)

    def link(src: pathlib.Path, dst: pathlib.Path) -> None:
        dst.mkdir(parents=True)
        for f in src.iterdir():
            if f.is_file():
                (dst / f.name).symlink_to(f.resolve())

    link(version_dir, root / STAGED / "1")
    for d in drafts:
        link(d.version_dir, root / d.label / "1")
        (root / d.label / "config.yaml").write_text(
            yaml.safe_dump(draft_config(d), sort_keys=False)
        )
    return root / STAGED / "1"


def _engine(version_dir: pathlib.Path, name: str, base: dict[str, Any],
            options: LlmOptimizeOptions) -> Any:  # fmt: skip
    from rtserve.errors import ConfigError
    from rtserve.runtime.llm.engine import LlmEngine
    from rtserve.runtime.llm.options import LlmOptions

    draft = options.draft_of(name)
    llm = variant_llm(base, name, draft.label if draft else "")
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
                  skipped: dict[str, str] | None = None,
                  staged: pathlib.Path | None = None) -> dict[str, Speed]:  # fmt: skip
    """Every variant's engine built once; rounds alternate between them. A variant whose
    engine cannot be built is left out, the reason in ``skipped``. ``staged``: the source in
    ``stage_drafts``'s repository (where +draft variants run)."""
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
                where = staged if staged is not None and options.draft_of(name) else version_dir
                engines[name] = _engine(where, name, base, options)
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
                                 weight_bytes=weight_bytes(version_dir, weights_of(name)))  # fmt: skip
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
        q = qualities[weights_of(name)]
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
        if name != weights_of(name):
            m.notes.append(f"quality of {weights_of(name)} (greedy output identical)")
        draft = options.draft_of(name)
        if draft is not None:
            whose = "the model itself" if draft.itself else draft.spec
            m.notes.append(f"drafts: {whose} at {draft.weights}")
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


def run_llm(version_dir: pathlib.Path, options: LlmOptimizeOptions, progress: bool = True,
            work: pathlib.Path | None = None) -> LlmResult:  # fmt: skip
    """Measure every variant and choose; ``work``: where the drafts' repository is staged
    (``WORK/draft-repo/``; a temporary folder without)."""
    import tempfile

    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        staged = None
        if options.drafts:
            root = (work if work is not None else pathlib.Path(tmp)) / "draft-repo"
            staged = stage_drafts(root, version_dir, options.drafts)
        speeds = measure_speed(version_dir, options, progress, skipped, staged)
    if progress:
        print("quality against FP32 ...", flush=True)
    built = {weights_of(n) for n in speeds}
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


def draft_target(out: pathlib.Path, draft: Draft) -> tuple[str, pathlib.Path | None]:
    """The name ``out``'s config.yaml gives ``draft``, and the model directory to write it
    to (None: that model of ``out``'s repository already is the draft)."""
    if draft.as_is and not draft.itself:
        model = draft.version_dir.parent.name
        there = _newest_version(out.parent / model)
        if there is not None and there.resolve() == draft.version_dir.resolve():
            return model, None
    name = f"{out.name}-draft"
    return name, out.parent / name


def check_draft_target(out: pathlib.Path) -> None:
    """``OUT-draft`` (where a chosen draft is written) is free or written by optimize-llm."""
    target = out.parent / f"{out.name}-draft"
    config = target / "config.yaml"
    if target.exists() and not (config.is_file() and config.read_text().startswith(WRITTEN)):
        raise OptimizeError(
            f"--draft: {target} exists and was not written by optimize-llm (a chosen draft "
            "model is written there, beside --out); choose another --out"
        )


def publish_llm(out: pathlib.Path, version_dir: pathlib.Path, result: LlmResult) -> pathlib.Path:
    """``out/config.yaml`` (the source's, with the chosen ``llm.weights`` / speculative),
    ``out/1/`` (the checkpoint's files) and ``out/optimization.json``; a chosen ``+draft``'s
    draft beside ``out`` as ``NAME-draft/`` unless ``draft_target`` finds it there."""
    import yaml

    assert result.chosen is not None
    if not out.name or out.name in (".", ".."):
        raise OptimizeError(f"--out must be REPO/NAME, got {out}")
    config, base = source_llm_section(version_dir)
    config = dict(config)
    draft = result.options.draft_of(result.chosen.name)
    draft_record: dict[str, Any] | None = None
    draft_model = ""
    if draft is not None:
        draft_model, target = draft_target(out, draft)
        if target is not None:
            check_draft_target(out)
            (target / "1").mkdir(parents=True, exist_ok=True)
            for f in draft.version_dir.iterdir():
                if f.is_file():
                    _place(f, target / "1" / f.name)
            head = f"{WRITTEN}: the draft model of {out.name}\n"
            (target / "config.yaml").write_text(
                head + yaml.safe_dump(draft_config(draft), sort_keys=False)
            )
        draft_record = {"spec": draft.spec, "model": draft_model, "weights": draft.weights,
                        "written": str(target) if target is not None else None}  # fmt: skip
    config["llm"] = variant_llm(base, result.chosen.name, draft_model)
    version = out / "1"
    version.mkdir(parents=True, exist_ok=True)
    for f in version_dir.iterdir():
        if f.is_file():
            _place(f, version / f.name)
    text = f"{WRITTEN}: {result.chosen.name} was chosen\n"
    (out / "config.yaml").write_text(text + yaml.safe_dump(config, sort_keys=False))
    o = result.options
    record = {
        "chosen": result.chosen.name,
        "llm": config["llm"],
        **({"draft": draft_record} if draft_record else {}),
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


def draft_specs(args: argparse.Namespace) -> tuple[str, ...]:
    """``--draft`` (repeated, each a comma list), in order, each once."""
    specs = (s.strip() for text in getattr(args, "draft", None) or () for s in text.split(","))
    return tuple(dict.fromkeys(s for s in specs if s))


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
    if draft_specs(args) and not speculative:
        raise OptimizeError(
            "--draft: its variants are the --speculative weights with the draft; "
            "--speculative is empty"
        )
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
    source_llm_section(version_dir)  # (a wrong backend is refused before minutes of work)
    if draft_specs(args):
        options = replace(options, drafts=resolve_drafts(version_dir, draft_specs(args)))
        if any(draft_target(out, d)[1] is not None for d in options.drafts):
            check_draft_target(out)
    work.mkdir(parents=True, exist_ok=True)
    result = run_llm(version_dir, options, progress=not args.no_progress, work=work)
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
        description="Build each llm.weights format (fp32, bf16, int8, int4) and speculative "
        "decoding (prompt lookup, --draft models) of a backend: llm model, measure tok/s at "
        "1, 8 and 32 streams, TTFT, "
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
                   help="weight formats that also get a prompt-lookup variant (and one per "
                   "--draft), comma list, '' for none (default: %(default)s)")  # fmt: skip
    p.add_argument("--draft", action="append", metavar="DIR_OR_NAME[@FORMAT]|FORMAT",
                   help="a draft model for +draft variants (speculative decoding, method: "
                   "draft): a model or version directory, or a model of the source's "
                   "repository, with the source's tokenizer, at its config's llm.weights or "
                   "@FORMAT; a bare FORMAT (int4): the source itself at it. Comma list or "
                   "repeated; a chosen draft is written beside --out as NAME-draft "
                   "(default: none)")  # fmt: skip
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
