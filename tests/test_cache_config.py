"""The response_cache config section: validation messages name the file and field; merging."""

from __future__ import annotations

from typing import Any

import pytest

from rtserve.cache import CacheConfig, MemoryTierConfig, RedisTierConfig, merge
from rtserve.errors import ConfigError

WHERE = "models/mlp/config.yaml"
URL = "redis://127.0.0.1:6379/0"


def parse(d: Any) -> CacheConfig:
    return CacheConfig.from_dict(d, WHERE)


def test_full_section_parses_into_typed_tiers() -> None:
    cfg = parse(
        {
            "memory": {"max_bytes": 1024, "ttl_s": 5},
            "redis": {"url": URL, "ttl_s": 30, "namespace": "prod", "timeout_ms": 20},
            "round_floats": 4,
        }
    )
    assert cfg.enabled
    assert cfg.memory == MemoryTierConfig(max_bytes=1024, ttl_s=5.0)
    assert cfg.redis == RedisTierConfig(url=URL, ttl_s=30.0, namespace="prod", timeout_ms=20.0)
    assert cfg.round_floats == 4


def test_absent_section_is_empty_and_false_disables() -> None:
    assert not parse(None).enabled
    assert not parse(False).enabled
    assert not parse({"enabled": False, "memory": {"max_bytes": 10}}).enabled


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"memory": {"max_bytes": -1}},
            "models/mlp/config.yaml: response_cache.memory.max_bytes: expected a positive integer, got -1",
        ),
        (
            {"memory": {"max_bytes": 10, "ttl_s": 0}},
            "response_cache.memory.ttl_s: expected a positive number, got 0",
        ),
        (
            {"memory": {"max_bytes": True}},
            "response_cache.memory.max_bytes: expected a positive integer",
        ),
        ({"memory": {"size": 10}}, "response_cache.memory: unknown field 'size'"),
        ({"memory": 5}, "response_cache.memory: expected a mapping"),
        ({"redis": {"ttl_s": 5}}, "response_cache.redis.url: required"),
        ({"redis": {"url": "http://x"}}, "response_cache.redis.url: expected a redis://"),
        ({"redis": {"url": URL, "namespace": "a b"}}, "response_cache.redis.namespace: expected"),
        (
            {"redis": {"url": URL, "ttl_s": "5"}},
            "response_cache.redis.ttl_s: expected a positive number",
        ),
        ({"redis": {"url": URL, "breaker_failures": 0}}, "response_cache.redis.breaker_failures"),
        (
            {"round_floats": 99},
            "response_cache.round_floats: expected an integer from 0 to 15, got 99",
        ),
        ({"enabled": "yes"}, "response_cache.enabled: expected true or false"),
        ({"tiers": {}}, "response_cache: unknown field 'tiers'"),
        ([1, 2], "response_cache: expected a mapping or false"),
    ],
)
def test_invalid_fields_are_named_with_file_and_path(section: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(section)
    assert message in str(info.value)
    assert str(info.value).startswith(WHERE + ": ")


def test_merge_model_tiers_override_defaults_tier_by_tier() -> None:
    default = CacheConfig.from_dict(
        {"memory": {"max_bytes": 100}, "redis": {"url": URL}, "round_floats": 3}, "server.yaml"
    )
    assert merge(default, None) == default
    assert merge(default, parse(None)) == default
    model = parse({"memory": {"max_bytes": 500, "ttl_s": 1}})
    merged = merge(default, model)
    assert merged.memory == MemoryTierConfig(500, 1.0)
    assert merged.redis == RedisTierConfig(url=URL)
    assert merged.round_floats == 3


def test_merge_model_can_drop_a_tier_or_disable_everything() -> None:
    default = CacheConfig.from_dict({"memory": {"max_bytes": 100}, "redis": {"url": URL}}, "s.yaml")
    no_redis = merge(default, parse({"redis": None}))
    assert no_redis.memory is not None and no_redis.redis is None
    assert not merge(default, parse(False)).enabled
    assert not merge(None, None).enabled
    assert merge(None, parse({"memory": {}})).memory == MemoryTierConfig()
