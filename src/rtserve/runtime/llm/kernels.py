"""rtserve's C++ kernels for the generation engine, built on first use with torch's extension
builder (g++ and ninja) and cached under torch's extension folder; a model falls back to
PyTorch's own operators when they cannot be built.

``paged_decode`` (csrc/paged_attention.cpp): decode attention reading the paged KV pool in
place, CPU float32. PyTorch's path gathers every sequence's blocks into a padded copy per
layer and reads it again; at 32 streams of SmolLM2-135M that copy and the padding were a third
of a decode step.

``rms_norm`` and ``silu_mul`` (same file): RMSNorm and the SiLU-gated product of a fused
gate/up projection, each one pass over its rows instead of five and two PyTorch operations
(each of which, on a decode step's small tensors, costs more in dispatch and thread wake-up
than in arithmetic). ``rope_store``: RoPE on the fused q/k/v projection's rows and the keys
and values into the pool, instead of eight operations and two scattered copies.

``qlinear`` (csrc/quant_linear.cpp, built as a second module): weight-only int8 / int4 /
bfloat16 linear layers for the rows of a decode step (``rtserve.runtime.llm.quant``), explicit AVX2 +
FMA code where the CPU has it, plain loops elsewhere.

On AVX-512 machines decode attention, the SiLU gate and the exponentials run on explicit
16-lane code (head sizes 32, 64, 128); elsewhere the compiler vectorizes plain loops.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
QUANT_SOURCE = Path(__file__).parent / "csrc" / "quant_linear.cpp"
_lock = threading.Lock()
_built: dict[str, Any] = {}


def paged_decode() -> Callable[..., Any] | None:
    """The kernel ``paged_decode(query [n, H, D], k_cache, v_cache, tables [n, B], lengths
    [n], scale) -> [n, H, D]``, or None (logged once) where it cannot be built."""
    module = fused_ops()
    return None if module is None else module.paged_decode


def fused_ops() -> Any | None:
    """The built module (``paged_decode``, ``rms_norm(x, weight, eps)``, ``silu_mul(gate_up)``,
    ``rope_store``, ``screen_logits``), built once; None (logged once) where it cannot be."""
    with _lock:
        if "ops" not in _built:
            _built["ops"] = _build()
        return _built["ops"]


def quant_ops() -> Any | None:
    """The built module of csrc/quant_linear.cpp (``qlinear``, ``has_avx2``), built once; None
    (logged once) where it cannot be."""
    with _lock:
        if "quant" not in _built:
            _built["quant"] = _build("rtserve_quant_linear", QUANT_SOURCE)
        return _built["quant"]


def _headers(source: Path) -> list[Path]:
    """The local headers ``source`` includes (``#include "x.h"``), and theirs."""
    found: list[Path] = []
    todo = [source]
    while todo:
        text = todo.pop().read_text()
        for name in re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE):
            path = source.parent / name
            if path not in found and path.is_file():
                found.append(path)
                todo.append(path)
    return sorted(found)


def _build(name: str = "rtserve_paged_attention", source: Path = SOURCE) -> Any:
    try:
        from torch.utils import cpp_extension

        # torch's builder hashes the listed sources only: the name carries their headers'
        # too (a changed header is a new build, not a stale cached one)
        digest = hashlib.sha256()
        for header in _headers(source):
            digest.update(header.read_bytes())
        return cpp_extension.load(
            f"{name}_{digest.hexdigest()[:10]}",
            [str(source)],
            extra_cflags=[
                "-O3",
                "-march=native",
                "-fopenmp",
                "-fno-math-errno",
                "-ffp-contract=off",
            ],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a build error: PyTorch's path serves
        log.warning(
            "llm: rtserve's CPU kernels (%s) could not be built (%s); using torch's", name, exc
        )
        return None


# ---- microbenchmark: python -m rtserve.runtime.llm.kernels --bench ----

SHAPES = {  # SmolLM2-135M's linear layers (out x in)
    "q/k/v": (960, 576),
    "o": (576, 576),
    "gate/up": (3072, 576),
    "up": (1536, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}


def bench(rows: tuple[int, ...] = (1, 2, 4, 8, 32), threads: tuple[int, ...] = (1, 2)) -> None:
    """Least ms (of many repeats) of each SmolLM2 shape: torch's FP32 ``F.linear`` against the int8 / int4
    kernels (their default activations), with the weight bytes read per second; then a
    large-array read (the memory-bandwidth ceiling). Busy machines: indicative figures."""
    import time

    import torch
    import torch.nn.functional as F

    from rtserve.runtime.llm.quant import QuantLinear

    ops = quant_ops()

    def timed(fn: Callable[..., Any], *args: Any, budget: float = 0.25) -> float:
        fn(*args)
        times: list[float] = []
        end = time.perf_counter() + budget
        while len(times) < 5 or (time.perf_counter() < end and len(times) < 2000):
            t = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t)
        return min(times) * 1e3

    print("threads rows shape        fp32 ms  int8 ms  int4 ms  i8/a8 ms | GB/s fp32 int8 int4")
    for nt in threads:
        torch.set_num_threads(nt)
        for name, (n, k) in SHAPES.items():
            lin = torch.nn.Linear(k, n, bias=False)
            q8, q4 = QuantLinear(lin, "int8", ops), QuantLinear(lin, "int4", ops)
            a8 = QuantLinear(lin, "int8", ops, act=1)  # int8 activations (few rows)
            for m in rows:
                x = torch.randn(m, k)
                for q in (q8, q4, a8):
                    q.kernel_rows = max(m, q.kernel_rows)
                with torch.inference_mode():
                    ts = [timed(F.linear, x, lin.weight)] + [timed(q, x) for q in (q8, q4, a8)]
                sizes = (4 * n * k, q8.nbytes, q4.nbytes)
                gbs = [b / t / 1e6 for b, t in zip(sizes, ts[:3], strict=True)]
                print(
                    f"{nt:7d} {m:4d} {name:9s}{n:6d}x{k:<4d}"
                    + "".join(f"{t:9.3f}" for t in ts)
                    + " | "
                    + " ".join(f"{g:4.0f}" for g in gbs)
                )
        big = torch.ones(64 << 20)  # 256 MB: read once per sum
        t = timed(torch.sum, big, budget=1.0)
        print(f"{nt:7d} read {big.numel() * 4 / t / 1e6:.1f} GB/s (torch sum of 256 MB)")


if __name__ == "__main__":
    import sys

    if "--bench" in sys.argv:
        bench()
    else:
        print("usage: python -m rtserve.runtime.llm.kernels --bench")
