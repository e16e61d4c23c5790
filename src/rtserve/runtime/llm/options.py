"""The ``llm:`` section of a model's config (and its token latency objective)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rtserve.errors import ConfigError

DTYPES = ("float32", "float16", "bfloat16")
WEIGHTS = ("fp32", "bf16", "int8", "int4")  # llm.weights (rtserve.runtime.llm.quant)
# A request's ``priority`` (lower runs first; 0 unless asked): asked for outside this range,
# it is refused (400); below the floor its key (or else its model's ``llm.min_priority``)
# allows, refused with 403.
PRIORITY_MIN, PRIORITY_MAX = -100, 100


@dataclass(frozen=True, slots=True)
class TokenSLO:
    """Objectives for tokens: first token (p99) and the gap between tokens (p99), in ms."""

    ttft_p99_ms: float = 0.0  # 0: not set
    itl_p99_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class LlmOptions:
    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "float32"
    weights: str = "fp32"  # fp32 | bf16 | int8 | int4: the linear layers' weights (llm/quant.py)
    max_num_seqs: int = 64
    max_model_len: int = 2048
    kv_cache_bytes: int = 0  # 0: sized from the model and the memory (llm/defaults.py)
    block_size: int = 16
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True
    threads: int = 0  # torch intra-op threads (0: the CPUs this process may use)
    cpu_linear: str = "onednn"  # onednn (prepacked weights) | torch (F.linear)
    cpu_attention: str = "kernel"  # kernel (paged, in place; torch if it cannot be built) | torch
    cpu_fused: bool = True  # Llama/Qwen2 layers and the greedy head on rtserve's kernels (CPU fp32)
    default_max_tokens: int = 256
    max_waiting: int = 1024  # requests queued beyond the running batch; more get a 503
    # Fair share between tenants (API keys' names; without keys, client addresses).
    fair_share: bool = True
    tenant_weights: tuple[tuple[str, float], ...] = ()  # (tenant, weight); others weigh 1
    max_waiting_per_tenant: int = 256  # one tenant's queued requests; more get a 429
    unread_timeout_s: float = 30.0  # a stream unread this long is paused (0: never)
    min_priority: int = 0  # the most urgent priority a request may ask without a key's grant
    slo: TokenSLO | None = None
    speculative: SpeculativeOptions | None = None  # off unless set (llm/speculative.py)

    @classmethod
    def parse(cls, data: dict[str, Any], where: str) -> LlmOptions:
        """The ``llm:`` mapping (with the model's ``slo:`` under ``slo``, as config.py
        hands it over); errors name the file and field."""
        data = dict(data)
        slo = data.pop("slo", None)
        speculative = data.pop("speculative", None)
        known = {f for f in cls.__dataclass_fields__ if f != "slo"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{where}: llm.{unknown[0]}: unknown field (known fields: {', '.join(sorted(known))})"
            )

        def integer(key: str, lo: int, hi: int) -> int:
            value = data.get(key, cls.__dataclass_fields__[key].default)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ConfigError(
                    f"{where}: llm.{key}: expected an integer in [{lo}, {hi}], got {value!r}"
                )
            return int(value)

        device = data.get("device", "auto")
        if not isinstance(device, str) or not (
            device in ("auto", "cpu", "cuda") or device.startswith("cuda:")
        ):
            raise ConfigError(
                f"{where}: llm.device: expected auto, cpu or cuda[:N], got {device!r}"
            )
        dtype = data.get("dtype", "float32")
        if dtype not in DTYPES:
            raise ConfigError(
                f"{where}: llm.dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}"
            )
        weights = data.get("weights", "fp32")
        if weights not in WEIGHTS:
            raise ConfigError(
                f"{where}: llm.weights: expected one of {', '.join(WEIGHTS)}, got {weights!r}"
            )
        cpu_linear = data.get("cpu_linear", "onednn")
        if cpu_linear not in ("onednn", "torch"):
            raise ConfigError(
                f"{where}: llm.cpu_linear: expected onednn or torch, got {cpu_linear!r}"
            )
        cpu_attention = data.get("cpu_attention", "kernel")
        if cpu_attention not in ("kernel", "torch"):
            raise ConfigError(
                f"{where}: llm.cpu_attention: expected kernel or torch, got {cpu_attention!r}"
            )
        prefix = data.get("prefix_caching", True)
        if not isinstance(prefix, bool):
            raise ConfigError(
                f"{where}: llm.prefix_caching: expected true or false, got {prefix!r}"
            )
        fused = data.get("cpu_fused", True)
        if not isinstance(fused, bool):
            raise ConfigError(f"{where}: llm.cpu_fused: expected true or false, got {fused!r}")
        fair = data.get("fair_share", True)
        if not isinstance(fair, bool):
            raise ConfigError(f"{where}: llm.fair_share: expected true or false, got {fair!r}")
        unread = data.get("unread_timeout_s", 30.0)
        if (
            isinstance(unread, bool)
            or not isinstance(unread, int | float)
            or not (0 <= unread <= 86400)
        ):
            raise ConfigError(
                f"{where}: llm.unread_timeout_s: expected seconds in [0, 86400] "
                f"(0: never pause an unread stream), got {unread!r}"
            )
        block_size = integer("block_size", 1, 1024)
        options = cls(
            device=device,
            dtype=dtype,
            weights=weights,
            max_num_seqs=integer("max_num_seqs", 1, 4096),
            max_model_len=integer("max_model_len", 2, 1 << 20),
            kv_cache_bytes=_kv_bytes(data.get("kv_cache_bytes", 0), where),
            block_size=block_size,
            max_num_batched_tokens=integer("max_num_batched_tokens", block_size, 1 << 20),
            prefix_caching=prefix,
            cpu_linear=cpu_linear,
            cpu_attention=cpu_attention,
            cpu_fused=fused,
            threads=integer("threads", 0, 1024),
            default_max_tokens=integer("default_max_tokens", 1, 1 << 20),
            max_waiting=integer("max_waiting", 0, 1 << 20),
            fair_share=fair,
            tenant_weights=_weights(data.get("tenant_weights"), where),
            max_waiting_per_tenant=integer("max_waiting_per_tenant", 0, 1 << 20),
            unread_timeout_s=float(unread),
            min_priority=integer("min_priority", PRIORITY_MIN, 0),
            slo=_token_slo(slo, where),
            speculative=_speculative(speculative, where),
        )
        return options


SPECULATIVE_METHODS = ("prompt_lookup", "draft")


@dataclass(frozen=True, slots=True)
class SpeculativeOptions:
    """``llm.speculative``: draft ``num_tokens`` tokens per step for each decoding sequence
    (n-grams of its own text, or a draft model of the repository), verified in one forward
    of the model; only while at most ``max_batch`` sequences decode. ``source``: the config
    file (errors about the draft model name it)."""

    method: str = "prompt_lookup"
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str = ""
    max_batch: int = 4
    source: str = ""


def _speculative(value: Any, where: str) -> SpeculativeOptions | None:
    """``llm.speculative: {method, num_tokens, ngram: {min, max}, draft_model, max_batch}``;
    absent or null: off."""
    if value is None:
        return None
    field = f"{where}: llm.speculative"
    known = {"method", "num_tokens", "ngram", "draft_model", "max_batch"}
    if not isinstance(value, dict):
        raise ConfigError(f"{field}: expected a mapping with {', '.join(sorted(known))}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(
            f"{field}.{unknown[0]}: unknown field (known fields: {', '.join(sorted(known))})"
        )
    method = value.get("method", "prompt_lookup")
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(
            f"{field}.method: expected one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}"
        )

    def integer(v: Any, name: str, lo: int, hi: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"{field}.{name}: expected an integer in [{lo}, {hi}], got {v!r}")
        return int(v)

    num = integer(value.get("num_tokens", 4), "num_tokens", 1, 16)
    max_batch = integer(value.get("max_batch", 4), "max_batch", 0, 4096)
    ngram = value.get("ngram") or {}
    if not isinstance(ngram, dict) or set(ngram) - {"min", "max"}:
        raise ConfigError(f"{field}.ngram: expected a mapping with min and/or max, got {ngram!r}")
    lo = integer(ngram.get("min", 2), "ngram.min", 1, 64)
    hi = integer(ngram.get("max", max(lo, 4)), "ngram.max", lo, 64)
    draft = value.get("draft_model", "")
    if method == "draft" and (not isinstance(draft, str) or not draft):
        raise ConfigError(
            f"{field}.draft_model: expected the name of a model in the repository "
            f"(method: draft), got {draft!r}"
        )
    if method == "prompt_lookup" and draft:
        raise ConfigError(f"{field}.draft_model: set only with method: draft")
    return SpeculativeOptions(method, num, lo, hi, draft or "", max_batch, where)


def _kv_bytes(value: Any, where: str) -> int:
    """``llm.kv_cache_bytes``: 0 (the default) sizes the pool from the model and memory."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (value == 0 or 1 << 16 <= value <= 1 << 40)
    ):
        raise ConfigError(
            f"{where}: llm.kv_cache_bytes: expected 0 (sized from the model and the memory) "
            f"or bytes in [{1 << 16}, {1 << 40}], got {value!r}"
        )
    return int(value)


def _weights(value: Any, where: str) -> tuple[tuple[str, float], ...]:
    """``tenant_weights: {tenant: weight}``: a tenant's share of the batch is its weight over
    the sum of the weights of the tenants using the model (1 for those not named)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > 10_000:
        raise ConfigError(
            f"{where}: llm.tenant_weights: expected a mapping of tenant (key name or client "
            f"address) to weight, got {value!r:.80}"
        )
    out = []
    for name, weight in value.items():
        if (
            not isinstance(name, str)
            or isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not 0.01 <= weight <= 1000
        ):
            raise ConfigError(
                f"{where}: llm.tenant_weights.{name}: expected a weight in [0.01, 1000], "
                f"got {weight!r:.40}"
            )
        out.append((name, float(weight)))
    return tuple(sorted(out))


def _token_slo(value: Any, where: str) -> TokenSLO | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not value or set(value) - {"ttft_p99_ms", "itl_p99_ms"}:
        raise ConfigError(
            f"{where}: slo: expected a mapping with ttft_p99_ms and/or itl_p99_ms "
            f"(milliseconds) for an llm model, got {value!r}"
        )
    out = {}
    for key in ("ttft_p99_ms", "itl_p99_ms"):
        v = value.get(key, 0.0)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 3_600_000:
            raise ConfigError(f"{where}: slo.{key}: expected milliseconds > 0, got {v!r}")
        out[key] = float(v)
    return TokenSLO(**out)
