"""Response cache: L1 in-process LRU+TTL, L2 Redis, single-flight, safe keys and values.

The dataplane creates one :class:`ResponseCache` per loaded model version whose merged
config (:func:`merge` of the server default and the model's ``response_cache``) is enabled,
and calls :meth:`ResponseCache.lookup_or_run` around the model run (or, from a
callback-style frontend, the synchronous :meth:`ResponseCache.lookup_memory` first and
:meth:`ResponseCache.fill` only on an L1 miss).
"""

from rtserve.cache.config import CacheConfig, MemoryTierConfig, RedisTierConfig, merge
from rtserve.cache.metrics import CacheMetrics
from rtserve.cache.response_cache import (
    OPT_OUT_PARAMETER,
    TIER_BYPASS,
    TIER_MEMORY,
    TIER_MISS,
    TIER_REDIS,
    ResponseCache,
    wants_cache,
)

__all__ = [
    "OPT_OUT_PARAMETER",
    "TIER_BYPASS",
    "TIER_MEMORY",
    "TIER_MISS",
    "TIER_REDIS",
    "CacheConfig",
    "CacheMetrics",
    "MemoryTierConfig",
    "RedisTierConfig",
    "ResponseCache",
    "merge",
    "wants_cache",
]
