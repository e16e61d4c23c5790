"""The cache value format: round trips every datatype; anything malformed is CacheDecodeError."""

from __future__ import annotations

import contextlib
import random
import struct

import numpy as np
import pytest

from rtserve.cache.codec import MAGIC, CacheDecodeError, decode, encode
from rtserve.protocol.types import DATATYPE_TO_NUMPY, Tensor


def tensor(name: str, datatype: str, data: np.ndarray) -> Tensor:
    return Tensor(name, datatype, tuple(data.shape), data)


def sample_outputs() -> list[Tensor]:
    out = []
    rng = np.random.default_rng(0)
    for datatype, dtype in DATATYPE_TO_NUMPY.items():
        if datatype == "BYTES":
            data = np.array([[b"a", b""], [b"\x00\xff" * 3, "é".encode()]], dtype=object)
        elif datatype == "BOOL":
            data = rng.integers(0, 2, size=(2, 3)).astype(bool)
        else:
            data = (rng.random((2, 3)) * 100).astype(dtype)
        out.append(tensor(f"out_{datatype.lower()}", datatype, data))
    out.append(tensor("empty", "FP32", np.zeros((0, 10), dtype=np.float32)))
    out.append(tensor("scalar", "INT64", np.array(7, dtype=np.int64)))
    return out


def test_round_trip_of_every_datatype_is_exact_and_read_only() -> None:
    original = sample_outputs()
    original[0].parameters = {"content_type": "bool", "n": 2}
    decoded = decode(encode(original))
    assert [t.name for t in decoded] == [t.name for t in original]
    for a, b in zip(original, decoded, strict=True):
        assert (a.datatype, a.shape) == (b.datatype, b.shape)
        assert b.data.dtype == a.data.dtype
        assert np.array_equal(a.data, b.data)
        assert not b.data.flags.writeable
    assert decoded[0].parameters == {"content_type": "bool", "n": 2}
    assert decoded[1].parameters is None


def test_non_contiguous_output_is_encoded_in_logical_order() -> None:
    wide = np.arange(20, dtype=np.float32).reshape(2, 10)[:, ::2]
    (d,) = decode(encode([tensor("y", "FP32", wide)]))
    assert np.array_equal(d.data, wide)


def test_unknown_datatype_cannot_be_encoded() -> None:
    with pytest.raises(ValueError, match="cannot be cached"):
        encode([Tensor("y", "BF16", (1,), np.zeros(1, dtype=np.float32))])


def valid() -> bytes:
    return encode([tensor("y", "FP32", np.arange(6, dtype=np.float32).reshape(2, 3))])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"", "truncated"),
        (b"\x80\x04\x95" + b"\x00" * 20, "not an rtserve cache value"),  # a pickle header
        (MAGIC + bytes([2, 0]) + b"\x00\x00", "unsupported cache format version 2"),
        (MAGIC + bytes([1, 1]) + b"\x00\x00", "unknown flags"),
        (valid()[:-5], "truncated"),
        (valid() + b"x", "trailing bytes"),
        (
            MAGIC
            + bytes([1, 0])
            + struct.pack("<H", 1)
            + struct.pack("<H", 1)
            + b"y"
            + bytes([99, 0]),
            "unknown datatype code 99",
        ),
        (
            MAGIC + bytes([1, 0]) + struct.pack("<H", 1) + struct.pack("<H", 2) + b"\xff\xfe",
            "not UTF-8",
        ),
        (
            MAGIC
            + bytes([1, 0])
            + struct.pack("<H", 1)
            + struct.pack("<H", 1)
            + b"y"
            + bytes([10, 1])
            + struct.pack("<Q", 3)
            + struct.pack("<Q", 8)
            + b"\x00" * 8
            + struct.pack("<I", 0),
            "does not fit shape",
        ),
        (
            MAGIC
            + bytes([1, 0])
            + struct.pack("<H", 1)
            + struct.pack("<H", 1)
            + b"y"
            + bytes([12, 1])
            + struct.pack("<Q", 2**40)
            + struct.pack("<Q", 8)
            + b"\x00" * 8,
            "BYTES elements do not fit",
        ),
        (
            MAGIC
            + bytes([1, 0])
            + struct.pack("<H", 1)
            + struct.pack("<H", 1)
            + b"y"
            + bytes([0, 1])
            + struct.pack("<Q", 1)
            + struct.pack("<Q", 1)
            + b"\x07"
            + struct.pack("<I", 0),
            "BOOL values",
        ),
        (
            MAGIC
            + bytes([1, 0])
            + struct.pack("<H", 1)
            + struct.pack("<H", 1)
            + b"y"
            + bytes([1, 1])
            + struct.pack("<Q", 1)
            + struct.pack("<Q", 1)
            + b"\x07"
            + struct.pack("<I", 3)
            + b"[1]",
            "parameters are not an object",
        ),
        (
            MAGIC
            + bytes([1, 0])
            + struct.pack("<H", 1)
            + struct.pack("<H", 1)
            + b"y"
            + bytes([11, 2])
            + struct.pack("<Q", 0)
            + struct.pack("<Q", 2**62)
            + struct.pack("<Q", 0)
            + struct.pack("<I", 0),
            "malformed value",
        ),
    ],
)
def test_malformed_values_raise_cache_decode_error(value: bytes, message: str) -> None:
    with pytest.raises(CacheDecodeError, match=message):
        decode(value)


def test_random_corruption_never_raises_anything_but_cache_decode_error() -> None:
    good = encode(sample_outputs())
    rng = random.Random(1)
    for _ in range(2000):
        bad = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        if rng.random() < 0.3:
            bad = bad[: rng.randrange(len(bad))]
        with contextlib.suppress(CacheDecodeError):
            decode(bytes(bad))
    for _ in range(500):
        with contextlib.suppress(CacheDecodeError):
            decode(MAGIC + bytes([1, 0]) + rng.randbytes(rng.randrange(64)))
