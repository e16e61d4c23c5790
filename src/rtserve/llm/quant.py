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
elsewhere) for the rows of a decode step (up to ``GEMV_ROWS``); for more rows (a prompt's
prefill) it dequantizes ``TILE_ROWS`` output rows of weights at a time to float32 and runs
torch's GEMM on them, so no full FP32 copy is kept. Without the built kernel, or off CPU,
torch operators do the same (dequantize per tile, then ``F.linear``)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

WEIGHTS = ("fp32", "bf16", "int8", "int4")
GROUP = 32
GEMV_ROWS = 16  # up to this many rows: the kernel; more: dequantized tiles and torch's GEMM
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
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    best_err = torch.full_like(lo, float("inf"))
    best_scale, best_min = torch.ones_like(lo), lo.clone()
    for ratio in CLIPS:
        mid = (lo + hi) / 2
        a, b = mid + (lo - mid) * ratio, mid + (hi - mid) * ratio
        scale = (b - a) / 15.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((groups - a[..., None]) / safe[..., None]).clamp_(0, 15)
        err = ((q * safe[..., None] + a[..., None] - groups) ** 2).sum(dim=2)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, safe, best_scale)
        best_min = torch.where(better, a, best_min)
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
            self.qweight, self.scales, self.mins = quantize_int4(weight)
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
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        bias = self.bias if self.bias.numel() else None
        if (
            self.ops is not None
            and rows.shape[0] <= self.kernel_rows
            and rows.dtype == torch.float32
            and not torch.is_grad_enabled()
        ):
            xin = rows if self.kp == self.in_features else F.pad(rows, (0, self.kp - shape[-1]))
            out = self.ops.qlinear(
                xin.contiguous(),
                self.qweight,
                self.scales,
                self.mins,
                self.bias,
                FMT[self.fmt],
                self.simd,
                self.act,
            )
        else:
            out = self.reference(rows.float(), bias).to(rows.dtype)
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


def inherit(new: torch.nn.Linear, old: torch.nn.Module) -> None:
    """``new`` (layers stacked into one) gets ``old``'s planned format."""
    fmt = getattr(old, "_rt_weights", None)
    if fmt is not None:
        new._rt_weights = fmt  # type: ignore[assignment]


def maker(ops: Any | None) -> Any:
    """A function making a linear layer's ``QuantLinear`` in its planned format."""

    def make(linear: torch.nn.Linear) -> torch.nn.Module:
        fmt = getattr(linear, "_rt_weights", "int8")
        return linear if fmt == "fp32" else QuantLinear(linear, fmt, ops)

    return make


def quantize_head(model: torch.nn.Module, make: Any) -> bool:
    """The LM head (tied to the input embedding or not) in its planned format; the input
    embedding keeps the checkpoint's weights (a step gathers a few rows of it)."""
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear:
        return False
    model.lm_head = make(head)  # type: ignore[assignment]
    return True
