"""The model side of a step: a transformers causal LM with its attention swapped for
``attention.paged_attention``, the key/value pool, and one packed forward per step."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rtserve.errors import ConfigError
from rtserve.runtime.llm import attention, kernels, quant
from rtserve.runtime.llm.attention import Chunk, StepContext
from rtserve.runtime.llm.defaults import kv_pool_bytes
from rtserve.runtime.llm.options import LlmOptions
from rtserve.runtime.llm.quant import linear_children
from rtserve.runtime.llm.scheduler import Step

log = logging.getLogger(__name__)

# Makes a linear layer's replacement (a quantized weight format); None: prepacked FP32.
Make = Callable[[torch.nn.Linear], torch.nn.Module] | None

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"llm.device: {name} asked for, but torch sees no CUDA device")
    return torch.device(name)


class ModelRunner:
    def __init__(self, version_dir: Path, options: LlmOptions) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        attention.register()
        # torch's default counts physical cores (1 on a 2-vCPU VM, which halves decode speed
        # there); the cores this process may run on is what a server wants.
        torch.set_num_threads(options.threads or len(os.sched_getaffinity(0)))
        self.device = resolve_device(options.device)
        self.dtype = _DTYPES[options.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(version_dir)
        check_architecture(version_dir)
        model: Any = AutoModelForCausalLM.from_pretrained(
            version_dir, dtype=self.dtype, attn_implementation=attention.ATTN_NAME
        )
        self.model = model.to(self.device).eval()
        self.weights = options.weights
        make: Make = None
        if self.weights != "fp32":
            qops = kernels.quant_ops() if self.device.type == "cpu" else None
            quant.plan(self.model, self.weights)
            if self.weights == "int4":
                quant.calibrate(self.model, self.tokenizer)
            make = quant.maker(qops)
            quant.quantize_head(self.model, make)
        self.fused = 0
        if options.cpu_fused and self.device.type == "cpu" and self.dtype == torch.float32:
            ops = kernels.fused_ops()
            if ops is not None:
                packed_hint = options.max_num_seqs if options.cpu_linear == "onednn" else None
                self.fused = fuse_modules(self.model, ops, packed_hint, make)
                log.info(
                    "llm %s: %d norms, MLPs and attentions on fused kernels",
                    version_dir,
                    self.fused,
                )
        self.screened_head: ScreenedHead | None = None
        if self.fused and options.cpu_linear == "onednn" and ScreenedHead.fits(self.model):
            self.screened_head = ScreenedHead(self.model.lm_head, ops, options.max_num_seqs)
            self.model.lm_head = self.screened_head
        if make is not None:
            pack_linears(self.model, options.max_num_seqs, make)  # (what the fused layers left)
            log.info(
                "llm %s: weights %s (%.0f MB of linear weights read per token)",
                version_dir, self.weights, quant.model_bytes(self.model) / 1e6,
            )  # fmt: skip
        elif options.cpu_linear == "onednn" and self.device.type == "cpu":
            pack_linears(self.model, options.max_num_seqs)  # (what the fused layers left)
            packed = sum(isinstance(getattr(m, "packed", None), torch.Tensor) for m in self.model.modules())  # fmt: skip
            log.info(
                "llm %s: %d GEMM weights prepacked for oneDNN (q/k/v and gate/up each one)",
                version_dir, packed,
            )  # fmt: skip
        config = self.model.config
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.vocab_size = int(config.vocab_size)
        layers = config.num_hidden_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        positions: Any = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        self.max_model_len = min(options.max_model_len, int(positions or options.max_model_len))
        window = sliding_window(self.model)
        if window is not None and window < self.max_model_len:
            log.warning(
                "llm %s: attention within a sliding window of %d tokens: max_model_len %d "
                "-> %d (full attention is exact inside the window)",
                version_dir, window, self.max_model_len, window,
            )  # fmt: skip
            self.max_model_len = window
        element = torch.tensor([], dtype=self.dtype).element_size()
        per_token = 2 * layers * kv_heads * head_dim * element
        self.block_size = options.block_size
        pool_bytes = options.kv_cache_bytes
        if not pool_bytes:  # (not set: sized from the model and the memory, and logged)
            pool_bytes, why = kv_pool_bytes(
                per_token, self.max_model_len, options.max_num_seqs, self.block_size,
                str(self.device),
            )  # fmt: skip
            log.info("llm %s: KV pool %d MiB (%s)", version_dir, pool_bytes >> 20, why)
        self.num_blocks = pool_bytes // (per_token * self.block_size)
        if self.num_blocks < 1:
            raise ConfigError(
                f"llm.kv_cache_bytes: {pool_bytes} bytes hold no block of "
                f"{self.block_size} tokens ({per_token} bytes per token for this model)"
            )
        slots = self.num_blocks * self.block_size
        if slots < self.max_model_len:  # (no sequence could grow to the model's length)
            log.warning(
                "llm %s: the KV pool holds %d tokens, fewer than max_model_len %d: "
                "max_model_len is %d (raise llm.kv_cache_bytes to serve longer contexts)",
                version_dir, slots, self.max_model_len, slots,
            )  # fmt: skip
            self.max_model_len = slots
        shape = (self.num_blocks, self.block_size, kv_heads, head_dim)
        self.k_cache = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)
        ]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        self.decode_kernel = None
        if (
            options.cpu_attention == "kernel"
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and not softcapped(self.model)  # (the kernel has no soft-capping)
        ):
            self.decode_kernel = kernels.paged_decode()
        self.bytes_per_token = per_token
        self._build_stack(version_dir, make is not None)
        log.info(
            "llm %s: %d layers, %d KV blocks of %d tokens (%d MiB) on %s, %s",
            version_dir, layers, self.num_blocks, self.block_size,
            per_token * slots >> 20, self.device, options.dtype,
        )  # fmt: skip
        release_openmp()

    def _build_stack(self, version_dir: Path, quantized: bool) -> None:
        """A decode step of a few rows in one call (int8 / int4 weights, fused layers)."""
        self.stack: Any = None
        self.stack_rows = 0
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        if quantized and self.fused and self.decode_kernel is not None:
            self.stack = decode_stack(self.model, kernels.quant_ops())
        if self.stack is not None:
            self.stack_rows = int(self.stack.max_rows())
            self.rope_table = rope_table(self.model, self.max_model_len)
            log.info(
                "llm %s: decode steps of up to %d rows in one call (decode stack)",
                version_dir, self.stack_rows,
            )  # fmt: skip

    def _packed(self, step: Step) -> tuple[list[int], list[int], list[int], list[int]]:
        """The step's tokens as one packed row: their ids, positions and KV slots, and the
        packed index of each item's last token."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        for seq, n in step.items:
            first = seq.computed
            ids.extend(seq.tokens[first : first + n])
            blocks = seq.blocks
            pos = range(first, first + n)
            positions.extend(pos)
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            last.append(len(ids) - 1)
        return ids, positions, slots, last

    def _context(self, step: Step) -> tuple[StepContext, list[int], list[int], list[int]]:
        """The attention context, the packed token ids and positions, and the packed
        index of each item's last token."""
        bs = self.block_size
        ids, positions, slots, last = self._packed(step)
        chunks: list[Chunk] = []
        tables: list[list[int]] = []
        lengths: list[int] = []
        dev = self.device
        for (seq, n), end in zip(step.items, last, strict=True):
            start = end - n + 1
            first = seq.computed
            blocks = seq.blocks
            context = first + n
            used = blocks[: -(-context // bs)]
            if n == 1:
                tables.append(used)
                lengths.append(context)
            elif first == 0:
                chunks.append(Chunk(start, n, context, None, None))
            else:
                rows = torch.arange(n, device=dev)[:, None] + first
                mask = torch.arange(len(used) * bs, device=dev)[None, :] <= rows
                chunks.append(Chunk(start, n, context, torch.tensor(used, device=dev), mask))
        decode_gather = decode_mask = decode_lengths = None
        if tables:
            widest = max(len(t) for t in tables)
            decode_gather = torch.tensor(
                [t + [t[0]] * (widest - len(t)) for t in tables], device=dev
            )
            decode_lengths = torch.tensor(lengths, device=dev)
            if self.decode_kernel is None:
                width = torch.arange(widest * bs, device=dev)[None, :]
                decode_mask = (width < decode_lengths[:, None])[:, None, None, :]
        ctx = StepContext(
            self.k_cache,
            self.v_cache,
            torch.tensor(slots, device=dev),
            len(tables),
            decode_gather,
            decode_mask,
            chunks,
            decode_lengths,
            self.decode_kernel,
            self.max_model_len,
        )
        return ctx, ids, positions, last

    @torch.inference_mode()
    def forward(
        self,
        step: Step,
        rows: list[int],
        exact: list[int] | None = None,
        extra: list[tuple[int, int, int]] | None = None,
        extra_exact: list[bool] | None = None,
    ) -> torch.Tensor:
        """Run the step; the logits [len(rows), vocab] at the last token of the items
        numbered ``rows`` (those that sample a token). ``exact``: the rows (indices into
        ``rows``) whose every logit is used (sampling, logprobs); the others are only
        argmax'd, which lets a ``ScreenedHead`` skip most of the vocabulary (None: all).
        ``extra``: (item, start, count) for more rows after those, exact: the logits at
        ``count`` tokens of item ``item`` from its ``start``-th in this step (a prompt's
        logprobs)."""
        if (
            self.stack is not None
            and step.tokens <= self.stack_rows
            and all(n == 1 or n == len(seq.draft) + 1 for seq, n in step.items)
        ):  # decodes, and drafts verified: a few rows in one call
            return self._run_stack(step, rows, extra)
        ctx, ids, positions, last = self._context(step)
        kept = kept_rows(step, last, rows, extra)
        if extra:
            # (``extra_exact``: per extra entry, whether its rows need every logit; a
            # speculative greedy sequence's verified rows need only their argmax)
            flags = extra_exact or [True] * len(extra)
            more: list[int] = []
            at = len(rows)
            for (_, _, count), flag in zip(extra, flags, strict=True):
                more.extend(range(at, at + count) if flag else ())
                at += count
            exact = None if exact is None else [*exact, *more]
        keep = torch.tensor(kept, dtype=torch.long, device=self.device)
        if self.screened_head is not None:
            self.screened_head.exact_rows = exact
        attention.set_step(ctx)
        try:
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                use_cache=False,
                logits_to_keep=keep,
            )
        finally:
            attention.set_step(None)
        return out.logits[0]

    def _run_stack(
        self, step: Step, rows: list[int], extra: list[tuple[int, int, int]] | None
    ) -> torch.Tensor:
        """``forward`` for a step of decodes and verified drafts (each token a row), its
        decoder layers in one ``DecodeStack`` call: the embeddings and rotary positions
        here, then the final norm and the head on the rows whose logits are asked for."""
        bs = self.block_size
        ids, positions, slots, last = self._packed(step)
        tables = [  # each row's blocks up to its own token
            seq.blocks[: p // bs + 1]
            for seq, n in step.items
            for p in range(seq.computed, seq.computed + n)
        ]
        kept = kept_rows(step, last, rows, extra)
        widest = max(len(t) for t in tables)
        inner = self.model.model
        x = inner.embed_tokens(torch.tensor(ids)).contiguous()
        if self.rope_table is not None:
            where = torch.tensor(positions)
            cos, sin = (t.index_select(0, where) for t in self.rope_table)
        else:
            cos, sin = (
                t[0].contiguous() for t in inner.rotary_emb(x[None], torch.tensor([positions]))
            )
        self.stack.run(
            x,
            cos,
            sin,
            self.k_cache,
            self.v_cache,
            torch.tensor(slots),
            torch.tensor([t + [t[0]] * (widest - len(t)) for t in tables]),
            torch.tensor([p + 1 for p in positions]),
        )
        if kept != list(range(len(ids))):
            x = x[kept]
        return self.model.lm_head(inner.norm(x))  # type: ignore[no-any-return]


def kept_rows(
    step: Step, last: list[int], rows: list[int], extra: list[tuple[int, int, int]] | None
) -> list[int]:
    """The packed indices whose logits ``forward`` returns: the last token of each item in
    ``rows``, then ``count`` tokens of item ``item`` from its ``start``-th per ``extra``."""
    kept = [last[r] for r in rows]
    for item, start, count in extra or ():
        first = last[item] - step.items[item][1] + 1 + start
        kept.extend(range(first, first + count))
    return kept


STATIC_ROPE = ("default", "linear", "llama3")  # rotary types whose angles depend on position only


@torch.inference_mode()
def rope_table(model: torch.nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's rotary cos and sin at positions 0..length-1 ([length, head_dim] each,
    the values its rotary module gives one position at a time), or None where they depend
    on more than the position (dynamic scaling) or would take over 32 MB."""
    inner: Any = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    config: Any = getattr(model, "config", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in STATIC_ROPE:
        return None
    hidden = int(config.hidden_size)
    dim = int(getattr(config, "head_dim", None) or hidden // config.num_attention_heads)
    if 2 * length * dim * 4 > 32 << 20:
        return None
    x = torch.zeros(1, 1, hidden)
    cos, sin = rotary(x, torch.arange(length)[None])
    return cos[0].contiguous(), sin[0].contiguous()


def decode_stack(model: torch.nn.Module, ops: Any) -> Any | None:
    """``model``'s decoder layers as one ``DecodeStack`` (csrc/decode_stack.h), or None: the
    stack needs a Llama or Qwen2 causal LM whose every layer is a ``FusedDecoderLayer`` with
    its four products on the int8 / int4 kernel (activation rows quantized, input widths a
    multiple of 32) and a plain linear head."""
    config: Any = getattr(model, "config", None)
    inner: Any = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", None) or [])
    if (
        ops is None
        or not hasattr(ops, "DecodeStack")
        or getattr(config, "model_type", None) not in ("llama", "qwen2")
        or getattr(config, "final_logit_softcapping", None) is not None
        or getattr(config, "logit_scale", None) is not None
        or not layers
        or not all(type(layer) is FusedDecoderLayer for layer in layers)
        or not hasattr(inner, "rotary_emb")
        or not hasattr(inner, "embed_tokens")
    ):
        return None
    first = layers[0].self_attn
    kv_heads = int(getattr(config, "num_key_value_heads", None) or first.heads)
    simd: bool | None = None
    stack = None
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.qkv, attn.o_proj, mlp.gate_up, mlp.down]
        for q in linears:
            if not (
                isinstance(q, quant.QuantLinear)
                and q.fmt in ("int8", "int4")
                and q.ops is not None
                and q.act in (1, 2)
                and q.kp == q.in_features
                and simd in (None, q.simd)
            ):
                return None
            simd = q.simd
        if stack is None:
            stack = ops.DecodeStack(
                int(config.hidden_size), first.heads, kv_heads, first.head_dim, first.scaling,
                bool(simd),
            )  # fmt: skip
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        stack.add_layer(
            norm1.weight.detach().float(),
            norm1.eps,
            norm2.weight.detach().float(),
            norm2.eps,
            [t for q in linears for t in (q.qweight, q.scales, q.mins, q.bias)],
            [quant.FMT[q.fmt] for q in linears],
            [q.act for q in linears],
        )
    return stack


class PackedLinear(torch.nn.Module):
    """A linear layer whose weight is prepacked once into oneDNN's blocked layout: on CPU
    it runs 1.3-2.3x faster than ``F.linear`` at the batch sizes of a decode step (the
    output differs from MKL's in the last bits, as any change of GEMM kernel does)."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(  # type: ignore[no-any-return]
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )


class ScreenedHead(torch.nn.Module):
    """The LM head when most rows only need their argmax (greedy decoding): logits from a
    bfloat16 copy of the weights (half the bytes; twice oneDNN's FP32 speed where the CPU
    has AVX512-BF16), then every column that could still be a row's argmax under a bound on
    the bfloat16 error is recomputed in FP32 (``screen_logits``; a few dozen of SmolLM2's
    49,152). The argmax is FP32's; rows in ``exact_rows`` get every logit in FP32."""

    UNIT = 2.0**-8  # bfloat16's relative rounding error (8 significant bits), with margin

    def __init__(self, lm_head: torch.nn.Linear, ops: Any, batch_hint: int) -> None:
        super().__init__()
        weight = lm_head.weight.detach()
        self.weight = weight
        self.exact = PackedLinear(lm_head, batch_hint)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), batch_hint)
        # |x.y - bf(x).bf(y)| <= (2u + u^2) sum |x_i||y_i| <= (2u + u^2) |x| |y|, plus the FP32
        # sums' own error (K * 2^-24 relative) and 1% to spare; the norms rounded up
        self.wnorm = (weight.double().norm(dim=1) * (1 + 1e-4)).float()
        u, k = self.UNIT, weight.shape[1]
        self.c = (2 * u + u * u + k * 2.0**-24) * 1.01
        self.ops = ops
        self.exact_rows: list[int] | None = None

    @staticmethod
    def fits(model: torch.nn.Module) -> bool:
        """A plain bias-free linear head (no logit scaling or soft-capping) on a CPU with
        native bfloat16 dot products."""
        head = getattr(model, "lm_head", None)
        config = getattr(model, "config", None)
        return (
            type(head) is torch.nn.Linear
            and head.bias is None
            and head.weight.dtype == torch.float32
            and head.weight.device.type == "cpu"
            and getattr(config, "final_logit_softcapping", None) is None
            and getattr(config, "logit_scale", None) is None
            and torch.backends.mkldnn.is_available()
            and torch.cpu._is_avx512_bf16_supported()
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.numel() == 0:  # a step of prompt chunks only: nothing is sampled
            return hidden.new_empty(*hidden.shape[:-1], self.weight.shape[0])
        h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        exact = self.exact_rows
        if exact is None or len(exact) == h.shape[0] or not bool(torch.isfinite(h).all()):
            return self.exact(h).view(*hidden.shape[:-1], -1)  # type: ignore[no-any-return]
        approx = torch.ops.mkldnn._linear_pointwise(h.bfloat16(), self.packed, None, "none", [], "")
        logits, columns = self.ops.screen_logits(
            approx, h.norm(dim=1), self.wnorm, self.c, self.UNIT
        )
        if columns.numel() == 0 or columns.numel() > self.weight.shape[0] // 8:
            logits = self.exact(h)  # (a bound too loose to help)
        else:
            logits[:, columns] = h @ self.weight[columns].t()
            if exact:
                rows = torch.tensor(exact, dtype=torch.long)
                logits[rows] = self.exact(h[rows].contiguous())
        return logits.view(*hidden.shape[:-1], -1)  # type: ignore[no-any-return]


class FusedLinears:
    """Linear layers that read the same input (q/k/v, gate/up) as one prepacked GEMM: one
    call instead of several, the same output bits. Each layer becomes a ``FusedPart``; the
    first part asked for an input computes all parts, the others take theirs."""

    def __init__(self, linears: list[torch.nn.Linear], batch_hint: int, make: Make = None) -> None:
        first = linears[0]
        both = torch.nn.Linear(
            first.in_features, sum(lin.out_features for lin in linears), bias=False, device="meta"
        )
        both.weight = torch.nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), False)
        biases = [lin.bias for lin in linears]
        if any(b is not None for b in biases):
            both.bias = torch.nn.Parameter(
                torch.cat(
                    [
                        lin.weight.new_zeros(lin.out_features) if b is None else b.detach()
                        for lin, b in zip(linears, biases, strict=True)
                    ]
                ),
                False,
            )
        quant.inherit(both, *linears)
        self.linear = make(both) if make is not None else PackedLinear(both, batch_hint)
        self.sizes = [lin.out_features for lin in linears]
        self._input: torch.Tensor | None = None
        self._parts: list[torch.Tensor] = []
        self._taken = 0

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input:
            out = self.linear(x.contiguous())
            self._input, self._parts, self._taken = x, list(out.split(self.sizes, -1)), 0
        part = self._parts[index]
        self._taken += 1
        if self._taken == len(self.sizes):  # every part handed out: hold nothing
            self._input, self._parts = None, []
        return part


class FusedPart(torch.nn.Module):
    def __init__(self, fused: FusedLinears, index: int) -> None:
        super().__init__()
        self.fused = fused
        self.index = index
        self.out_features = fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.index, x)


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm (Llama's and Qwen2's: ``weight * x / sqrt(mean(x^2) + eps)``) in one kernel."""

    def __init__(self, norm: Any, ops: Any) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)  # type: ignore[no-any-return]


def _packed(linear: torch.nn.Linear, batch_hint: int | None, make: Make = None) -> torch.nn.Module:
    """``linear`` as ``make`` makes it (a quantized weight format), else prepacked for oneDNN
    with ``batch_hint``, else as it is (``F.linear``)."""
    if make is not None:
        return make(linear)
    return PackedLinear(linear, batch_hint) if batch_hint else linear


def _stacked(
    linears: list[torch.nn.Linear], batch_hint: int | None, make: Make = None
) -> torch.nn.Module:
    """Linear layers that read one input (all with a bias or none) as one layer whose output
    is theirs side by side, prepacked with ``batch_hint``."""
    first = linears[0]
    both = torch.nn.Linear(
        first.in_features,
        sum(lin.out_features for lin in linears),
        bias=first.bias is not None,
        device="meta",
    )
    both.weight = torch.nn.Parameter(torch.cat([lin.weight for lin in linears]).detach(), False)
    if first.bias is not None:
        both.bias = torch.nn.Parameter(torch.cat([lin.bias for lin in linears]).detach(), False)
    quant.inherit(both, *linears)
    return _packed(both, batch_hint, make)


class FusedMLP(torch.nn.Module):
    """A SiLU-gated MLP (``down(silu(gate(x)) * up(x))``) as one GEMM for gate and up, one
    kernel for the gate, and the down projection; prepacked for oneDNN with ``batch_hint``,
    else ``F.linear``."""

    def __init__(self, mlp: Any, ops: Any, batch_hint: int | None, make: Make = None) -> None:
        super().__init__()
        self.gate_up = _stacked([mlp.gate_proj, mlp.up_proj], batch_hint, make)
        self.down = _packed(mlp.down_proj, batch_hint, make)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x.reshape(-1, x.shape[-1]).contiguous())
        out = self.down(self.ops.silu_mul(gate_up))
        return out.view(*x.shape[:-1], out.shape[-1])  # type: ignore[no-any-return]


class FusedAttention(torch.nn.Module):
    """Llama's and Qwen2's attention with q/k/v as one GEMM, and RoPE and the key/value store
    as one kernel over its output (``rope_store``): the step's paged attention (``attention.
    attend``) then the output projection. Prepacked for oneDNN with ``batch_hint``."""

    def __init__(self, attn: Any, ops: Any, batch_hint: int | None, make: Make = None) -> None:
        super().__init__()
        config = attn.config
        self.layer_idx = int(attn.layer_idx)
        self.heads = int(config.num_attention_heads)
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        self.qkv = _stacked([attn.q_proj, attn.k_proj, attn.v_proj], batch_hint, make)
        self.o_proj = _packed(attn.o_proj, batch_hint, make)
        self.ops = ops

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        out = self.attend(hidden_states.reshape(-1, hidden_states.shape[-1]), position_embeddings)
        return out.view(*hidden_states.shape[:-1], -1), None

    def attend(
        self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] for the packed step."""
        ctx = attention.current()
        layer = self.layer_idx
        qkv = self.qkv(x.contiguous())
        cos, sin = position_embeddings
        self.ops.rope_store(
            qkv, cos[0], sin[0], ctx.k_cache[layer], ctx.v_cache[layer], ctx.slots, self.heads
        )
        tokens, dim = qkv.shape[0], self.head_dim
        q_end = self.heads * dim
        q = qkv[:, :q_end].view(tokens, self.heads, dim)
        if ctx.chunks:  # a prompt's first chunk attends to its own keys and values
            kv = (qkv.shape[1] - q_end) // 2
            k = qkv[:, q_end : q_end + kv].view(tokens, -1, dim)
            v = qkv[:, q_end + kv :].view(tokens, -1, dim)
            out = attention.attend(ctx, layer, q, k, v, self.scaling)
        else:
            out = attention.attend(ctx, layer, q, None, None, self.scaling)
        return self.o_proj(out.view(tokens, -1))  # type: ignore[no-any-return]


class FusedDecoderLayer(torch.nn.Module):
    """A pre-norm decoder layer (Llama's, Qwen2's) whose norms, attention and MLP are all
    fused: ``x + attn(norm(x))``, then ``+ mlp(norm(x))``, the sums in place, with no module
    dispatch in between."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.input_layernorm: FusedRMSNorm = layer.input_layernorm
        self.self_attn: FusedAttention = layer.self_attn
        self.post_attention_layernorm: FusedRMSNorm = layer.post_attention_layernorm
        self.mlp: FusedMLP = layer.mlp

    def forward(
        self,
        hidden_states: torch.Tensor,
        *args: Any,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        **kwargs: Any,
    ) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        attn = self.self_attn.attend(self.input_layernorm.forward(x), position_embeddings)
        x = x + attn
        x += self.mlp.forward(self.post_attention_layernorm.forward(x))
        return x.view(hidden_states.shape)


def _fusable_layer(module: torch.nn.Module) -> bool:
    return (
        type(module).__name__ in ("LlamaDecoderLayer", "Qwen2DecoderLayer")
        and isinstance(getattr(module, "input_layernorm", None), FusedRMSNorm)
        and isinstance(getattr(module, "post_attention_layernorm", None), FusedRMSNorm)
        and isinstance(getattr(module, "self_attn", None), FusedAttention)
        and isinstance(getattr(module, "mlp", None), FusedMLP)
    )


def _rope_attention(module: torch.nn.Module) -> bool:
    """Llama's or Qwen2's attention with full rotate-half RoPE and no sliding window."""
    if type(module).__name__ not in ("LlamaAttention", "Qwen2Attention"):
        return False
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if not all(type(getattr(module, n, None)) is torch.nn.Linear for n in names):
        return False
    if getattr(module, "sliding_window", None) is not None:
        return False
    config = getattr(module, "config", None)
    rope = getattr(config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    biases = {getattr(module, n).bias is None for n in names[:3]}
    return partial in (None, 1.0) and len(biases) == 1 and hasattr(module, "layer_idx")


def fuse_modules(
    model: torch.nn.Module, ops: Any, batch_hint: int | None, make: Make = None
) -> int:
    """Swap Llama/Qwen2-style RMSNorms, SiLU-gated MLPs and RoPE attentions of ``model``
    (CPU, float32) for ``FusedRMSNorm``, ``FusedMLP`` and ``FusedAttention``; others (GPT-2's LayerNorm and GELU, biased halves)
    stay as they are. How many were swapped."""
    if batch_hint is not None and not torch.backends.mkldnn.is_available():
        batch_hint = None
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            weight = getattr(child, "weight", None)
            if (
                type(child).__name__.endswith("RMSNorm")
                and hasattr(child, "variance_epsilon")
                and isinstance(weight, torch.Tensor)
                and weight.dim() == 1
            ):
                swaps.append((parent, name, FusedRMSNorm(child, ops)))
            elif _silu_gated(child):
                swaps.append((parent, name, FusedMLP(child, ops, batch_hint, make)))
            elif _rope_attention(child):
                swaps.append((parent, name, FusedAttention(child, ops, batch_hint, make)))
    for parent, name, new in swaps:
        setattr(parent, name, new)
    layers = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _fusable_layer(child)
    ]
    for parent, name, child in layers:
        setattr(parent, name, FusedDecoderLayer(child))
    return len(swaps)


def _silu_gated(module: torch.nn.Module) -> bool:
    linears = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)
    return (
        all(type(lin) is torch.nn.Linear for lin in linears)
        and type(act).__name__ in ("SiLU", "SiLUActivation")
        and (linears[0].bias is None) == (linears[1].bias is None)  # type: ignore[union-attr]
    )


FUSE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def pack_linears(model: torch.nn.Module, batch_hint: int, make: Make = None) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a ``PackedLinear`` (the projections of
    one input, ``FUSE``, for ``FusedPart`` of one GEMM), or for what ``make`` makes of it (a
    quantized weight format); how many were."""
    if make is None and not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for module in model.modules():
        for names in FUSE:
            linears: list[Any] = [getattr(module, n, None) for n in names]
            if all(type(lin) is torch.nn.Linear for lin in linears):
                fused = FusedLinears(linears, batch_hint, make)
                for i, n in enumerate(names):
                    setattr(module, n, FusedPart(fused, i))
                count += len(names)
    swaps = linear_children(model)
    for parent, name, child in swaps:
        setattr(parent, name, make(child) if make is not None else PackedLinear(child, batch_hint))
    return count + len(swaps)


def release_openmp() -> bool:
    """End the calling thread's OpenMP worker pool (loading and warmup made one).

    libgomp counts the workers of every thread's pool; once they outnumber the CPUs, it
    stops spinning between parallel regions and every small op in the step loop's thread
    pays a futex wake-up (silu on [32, 1536]: 14 -> 55 us here; a 32-sequence decode
    step ~20% slower). A later parallel op on this thread makes a new pool."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
        done = False
        for path in libs:
            done |= ctypes.CDLL(path).omp_pause_resource_all(1) == 0  # omp_pause_soft
        return done
    except (OSError, AttributeError):  # not Linux, or an OpenMP without it
        return False


def check_architecture(version_dir: Path) -> None:
    """Refuse a model whose attention does not go through transformers' attention
    interface, where the paged KV cache plugs in (it would run without its context)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(version_dir)
    try:
        cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ConfigError(
            f"llm: model_type {config.model_type!r} in {version_dir}/config.json is not a "
            "causal language model (no AutoModelForCausalLM class for it)"
        ) from None
    if not getattr(cls, "_supports_attention_backend", False):
        raise ConfigError(
            f"llm: {cls.__name__} ({config.model_type!r}) computes attention its own way, "
            "not through transformers' attention interface that the paged KV cache plugs "
            "into; architectures that do include Llama, Mistral, Qwen2/3, Gemma, Phi, "
            "GPT-2, GPT-J, GPT-NeoX, OPT"
        )


def sliding_window(model: torch.nn.Module) -> int | None:
    """The shortest sliding attention window of any layer (None: full attention)."""
    config: Any = getattr(model, "config", None)
    sizes: list[int] = [
        w
        for m in model.modules()
        if isinstance(w := getattr(m, "sliding_window", None), int) and hasattr(m, "layer_idx")
    ]
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if (
        isinstance(window, int)
        and getattr(config, "use_sliding_window", True) is not False
        and (types is None or "sliding_attention" in types)
    ):
        sizes.append(window)
    return min(sizes) if sizes else None


def softcapped(model: torch.nn.Module) -> bool:
    """Attention scores soft-capped (Gemma 2)."""
    return getattr(getattr(model, "config", None), "attn_logit_softcapping", None) is not None


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The end-of-sequence ids ``generate`` stops on: the generation config's, else the
    model config's, else the tokenizer's."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            return frozenset((value,))
        if isinstance(value, list | tuple) and value:
            return frozenset(int(v) for v in value)
    return frozenset()
