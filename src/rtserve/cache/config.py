"""The ``response_cache`` section of a model's (or the server's) config, validated.

```yaml
response_cache:
  memory: {max_bytes: 67108864, ttl_s: 60}          # L1, in-process
  redis:  {url: "redis://127.0.0.1:6379/0", ttl_s: 600, namespace: prod,    # L2
           hmac_key_env: RTSERVE_CACHE_KEY}   # or hmac_key: "..." (at least 16 bytes)
  round_floats: 4                                   # optional: key on rounded float inputs
```

``response_cache: false`` (or ``{enabled: false}``) turns the cache off for a model even when
the server has a default. Every error names the file and the field.

Redis values are authenticated: each is stored with an HMAC-SHA256 over the Redis key
and the value, keyed by ``hmac_key`` (or the environment variable named by
``hmac_key_env``). Without a key, each process signs with its own random key: Redis
still works as a cache for that process (and survives its L1 evictions), but replicas
do not share entries and a restarted server rejects them. Configure the same key on every
replica (the documented config reads it from ``RTSERVE_CACHE_KEY``) to share them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rtserve.errors import ConfigError

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MIN_HMAC_KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class MemoryTierConfig:
    """L1: an in-process LRU bounded by ``max_bytes``; entries expire after ``ttl_s``."""

    max_bytes: int = 64 * 1024 * 1024
    ttl_s: float = 60.0


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """L2: Redis at ``url``; keys live ``ttl_s`` under ``rtserve:{namespace}:{model}:{version}:``.

    Each socket operation gives up after ``timeout_ms`` and a whole call after twice that;
    after ``breaker_failures`` consecutive failures Redis is skipped for
    ``breaker_cooldown_s``, then probed in the background. At most ``max_pending_writes``
    writes wait for Redis; more are dropped (and counted).

    ``hmac_key``: the key that signs and checks values (from ``hmac_key`` or the variable
    named by ``hmac_key_env``); None: a random key per process (no sharing).
    """

    url: str
    ttl_s: float = 300.0
    namespace: str = "default"
    timeout_ms: float = 50.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    max_pending_writes: int = 1024
    hmac_key: bytes | None = field(default=None, repr=False)
    hmac_key_env: str | None = None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """A validated response-cache config; ``enabled`` is False when no tier is configured.

    ``explicit`` records which top-level fields the source mapping named, so that
    :func:`merge` can tell "inherit the server default" from "turned off here".
    """

    memory: MemoryTierConfig | None = None
    redis: RedisTierConfig | None = None
    round_floats: int | None = None
    explicit: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def enabled(self) -> bool:
        return self.memory is not None or self.redis is not None

    @classmethod
    def disabled(cls) -> CacheConfig:
        return cls(explicit=frozenset({"enabled"}))

    @classmethod
    def from_dict(cls, d: Any, where: str, section: str = "response_cache") -> CacheConfig:
        """Validate the mapping found at ``section`` of the file ``where``.

        ``None`` (section absent) gives an empty config that inherits everything in
        :func:`merge`; ``False`` turns the cache off.
        """
        if d is None:
            return cls()
        if d is False:
            return cls.disabled()
        p = _Path(where, section)
        if not isinstance(d, Mapping):
            raise p.error("expected a mapping or false", d)
        p.reject_unknown(d, ("enabled", "memory", "redis", "round_floats"))
        if "enabled" in d:
            enabled = d["enabled"]
            if not isinstance(enabled, bool):
                raise p.child("enabled").error("expected true or false", enabled)
            if not enabled:
                return cls.disabled()
        memory = _memory_tier(d["memory"], p.child("memory")) if "memory" in d else None
        redis = _redis_tier(d["redis"], p.child("redis")) if "redis" in d else None
        round_floats = None
        if d.get("round_floats") is not None:
            round_floats = p.child("round_floats").integer(d["round_floats"], 0, 15)
        return cls(memory, redis, round_floats, explicit=frozenset(str(k) for k in d))


def merge(server_default: CacheConfig | None, model_cfg: CacheConfig | None) -> CacheConfig:
    """Combine the server-wide default with a model's own section, tier by tier.

    A tier (or ``round_floats``) the model names replaces the default's; one it does not
    name is inherited; ``memory: null`` drops an inherited tier; ``response_cache: false``
    turns everything off. The result may be disabled: check ``.enabled``.
    """
    base = server_default if server_default is not None else CacheConfig()
    if model_cfg is None:
        return base
    if "enabled" in model_cfg.explicit and not model_cfg.enabled:
        return CacheConfig.disabled()
    named = model_cfg.explicit
    return CacheConfig(
        memory=model_cfg.memory if "memory" in named else base.memory,
        redis=model_cfg.redis if "redis" in named else base.redis,
        round_floats=model_cfg.round_floats if "round_floats" in named else base.round_floats,
        explicit=base.explicit | named,
    )


def _memory_tier(d: Any, p: _Path) -> MemoryTierConfig | None:
    if d is None or d is False:
        return None
    if not isinstance(d, Mapping):
        raise p.error("expected a mapping with max_bytes and ttl_s", d)
    p.reject_unknown(d, ("max_bytes", "ttl_s"))
    default = MemoryTierConfig()
    return MemoryTierConfig(
        max_bytes=p.child("max_bytes").integer(d.get("max_bytes", default.max_bytes), 1),
        ttl_s=p.child("ttl_s").positive(d.get("ttl_s", default.ttl_s)),
    )


def _redis_tier(d: Any, p: _Path) -> RedisTierConfig | None:
    if d is None or d is False:
        return None
    if not isinstance(d, Mapping):
        raise p.error("expected a mapping with url, ttl_s and namespace", d)
    p.reject_unknown(d, tuple(RedisTierConfig.__dataclass_fields__))
    if "url" not in d:
        raise p.child("url").error("required, e.g. redis://127.0.0.1:6379/0", None)
    url = d["url"]
    if not isinstance(url, str) or not url.startswith(_REDIS_SCHEMES):
        raise p.child("url").error("expected a redis://, rediss:// or unix:// URL", url)
    namespace = d.get("namespace", "default")
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise p.child("namespace").error("expected 1-64 characters of [A-Za-z0-9_.-]", namespace)
    default = RedisTierConfig(url=url)
    key_env = d.get("hmac_key_env")
    return RedisTierConfig(
        url=url,
        ttl_s=p.child("ttl_s").positive(d.get("ttl_s", default.ttl_s)),
        namespace=namespace,
        timeout_ms=p.child("timeout_ms").positive(d.get("timeout_ms", default.timeout_ms)),
        breaker_failures=p.child("breaker_failures").integer(
            d.get("breaker_failures", default.breaker_failures), 1
        ),
        breaker_cooldown_s=p.child("breaker_cooldown_s").positive(
            d.get("breaker_cooldown_s", default.breaker_cooldown_s)
        ),
        max_pending_writes=p.child("max_pending_writes").integer(
            d.get("max_pending_writes", default.max_pending_writes), 1
        ),
        hmac_key=_hmac_key(d, p),
        hmac_key_env=key_env,
    )


def _hmac_key(d: Mapping[str, Any], p: _Path) -> bytes | None:
    """The configured signing key; errors never show the key itself."""
    if "hmac_key" in d and "hmac_key_env" in d:
        raise ConfigError(f"{p.where}: {p.dotted}: give hmac_key or hmac_key_env, not both")
    if "hmac_key" in d:
        value = d["hmac_key"]
        where = p.child("hmac_key")
        if not isinstance(value, str):
            raise ConfigError(f"{where.where}: {where.dotted}: expected a string")
    elif "hmac_key_env" in d:
        name = d["hmac_key_env"]
        where = p.child("hmac_key_env")
        if not isinstance(name, str) or not _ENV_NAME_RE.match(name):
            raise where.error("expected an environment variable name", name)
        env = os.environ.get(name)
        if env is None:
            raise ConfigError(
                f"{where.where}: {where.dotted}: environment variable {name} is not set"
            )
        value = env
    else:
        return None
    key = value.encode()
    if len(key) < MIN_HMAC_KEY_BYTES:
        raise ConfigError(
            f"{where.where}: {where.dotted}: the key must have at least "
            f"{MIN_HMAC_KEY_BYTES} bytes, got {len(key)}"
        )
    return key


@dataclass(frozen=True, slots=True)
class _Path:
    """A field's location, for error messages: ``file: response_cache.memory.max_bytes``."""

    where: str
    dotted: str

    def child(self, name: str) -> _Path:
        return _Path(self.where, f"{self.dotted}.{name}")

    def error(self, expected: str, got: Any) -> ConfigError:
        return ConfigError(f"{self.where}: {self.dotted}: {expected}, got {got!r}")

    def reject_unknown(self, d: Mapping[Any, Any], known: tuple[str, ...]) -> None:
        for key in d:
            if key not in known:
                raise ConfigError(
                    f"{self.where}: {self.dotted}: unknown field {key!r} "
                    f"(expected one of: {', '.join(known)})"
                )

    def integer(self, v: Any, lo: int, hi: int | None = None) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            if hi is not None:
                raise self.error(f"expected an integer from {lo} to {hi}", v)
            raise self.error(
                "expected a positive integer" if lo == 1 else f"expected an integer >= {lo}", v
            )
        return v

    def positive(self, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise self.error("expected a positive number", v)
        return float(v)
