"""Cache keys: equal requests share a key; a difference in any keyed field never does."""

from __future__ import annotations

import numpy as np

from rtserve.cache.keys import cache_key
from rtserve.protocol.types import RequestedOutput, Tensor


def t(name: str, data: np.ndarray, datatype: str = "FP32") -> Tensor:
    return Tensor(name, datatype, tuple(data.shape), data)


X = np.arange(12, dtype=np.float32).reshape(3, 4)


def key(inputs: list[Tensor], outputs: list[RequestedOutput] | None = None, **kw: object) -> bytes:
    model = str(kw.pop("model", "mlp"))
    version = str(kw.pop("version", "1"))
    rnd = kw.pop("round_floats", None)
    assert rnd is None or isinstance(rnd, int)
    return cache_key(model, version, inputs, outputs, rnd)


def test_same_request_same_key_and_key_is_32_bytes() -> None:
    k = key([t("x", X)])
    assert k == key([t("x", X.copy())])
    assert len(k) == 32


def test_any_keyed_difference_changes_the_key() -> None:
    base = key([t("x", X)], [RequestedOutput("y")])
    variants = [
        key([t("x", X)], [RequestedOutput("y")], model="mlp2"),
        key([t("x", X)], [RequestedOutput("y")], version="2"),
        key([t("z", X)], [RequestedOutput("y")]),
        key([t("x", X.view(np.int32), "INT32")], [RequestedOutput("y")]),
        key([t("x", X.reshape(4, 3))], [RequestedOutput("y")]),
        key([t("x", X.reshape(12))], [RequestedOutput("y")]),
        key([t("x", X + np.float32(1e-6))], [RequestedOutput("y")]),
        key([t("x", X)], [RequestedOutput("y2")]),
        key([t("x", X)], [RequestedOutput("y"), RequestedOutput("z")]),
        key([t("x", X)], None),
        key([t("x", X), t("w", X)], [RequestedOutput("y")]),
        # the classification extension answers other bytes for the same output
        key([t("x", X)], [RequestedOutput("y", classification=2)]),
        key([t("x", X)], [RequestedOutput("y", classification=3)]),
        key([t("x", X)], [RequestedOutput("y"), RequestedOutput("z", classification=1)]),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_framing_is_unambiguous_across_field_boundaries() -> None:
    # "ab"+"c" vs "a"+"bc" as model/version must not collide.
    assert key([t("x", X)], model="ab", version="c") != key([t("x", X)], model="a", version="bc")
    b1 = np.array([b"ab", b"c"], dtype=object)
    b2 = np.array([b"a", b"bc"], dtype=object)
    assert key([t("s", b1, "BYTES")]) != key([t("s", b2, "BYTES")])


def test_binary_flag_input_order_and_empty_output_list_do_not_matter() -> None:
    a, b = t("a", X), t("b", X * 2)
    assert key([a, b]) == key([b, a])
    assert key([a], []) == key([a], None)
    assert key([a], [RequestedOutput("y", binary=True)]) == key([a], [RequestedOutput("y", False)])


def test_non_contiguous_input_hashes_its_logical_contents() -> None:
    wide = np.arange(24, dtype=np.float32).reshape(3, 8)
    view = wide[:, ::2]
    assert not view.flags.c_contiguous
    assert key([t("x", view)]) == key([t("x", np.ascontiguousarray(view))])


def test_rounding_shares_keys_of_nearby_floats_only_when_enabled() -> None:
    a = np.array([[0.123441, -0.000001]], dtype=np.float32)
    b = np.array([[0.123449, 0.000001]], dtype=np.float32)
    assert key([t("x", a)]) != key([t("x", b)])
    assert key([t("x", a)], round_floats=4) == key([t("x", b)], round_floats=4)
    c = np.array([[0.1236, 0.0]], dtype=np.float32)
    assert key([t("x", a)], round_floats=4) != key([t("x", c)], round_floats=4)
    ints = np.array([[1, 2]], dtype=np.int64)
    assert key([t("i", ints, "INT64")], round_floats=0) == key([t("i", ints, "INT64")])


def test_bytes_elements_str_and_bytes_agree() -> None:
    s = np.array(["héllo", "x"], dtype=object)
    b = np.array(["héllo".encode(), b"x"], dtype=object)
    assert key([t("s", s, "BYTES")]) == key([t("s", b, "BYTES")])
