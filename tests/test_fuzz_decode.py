"""Property tests of the V2 decoders (JSON, binary extension, gRPC): random and mutated
inputs either decode into tensors that agree with their shapes, or raise a 4xx
RTServeError; nothing else escapes, and no call allocates beyond a budget set by the
decode limits and the input's own size (tracemalloc peak). Bounded: a few seconds."""

from __future__ import annotations

import json
import math
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtserve.errors import RTServeError
from rtserve.protocol import grpc_service_pb2 as pb
from rtserve.protocol.grpc_codec import decode_model_infer
from rtserve.protocol.http_codec import decode_infer_request
from rtserve.protocol.limits import DecodeLimits
from rtserve.protocol.types import DATATYPE_TO_NUMPY, InferRequest

LIMITS = DecodeLimits(
    max_elements=1 << 12, max_bytes_elements=1 << 9, max_json_depth=8, max_json_containers=256
)
# What one decode may allocate: the limits' worth of elements plus what parsing the input
# itself costs (Python objects per input byte), never what a shape claims.
BASE_BUDGET = 256 * 1024 + LIMITS.max_elements * 8 + LIMITS.max_bytes_elements * 64
PER_INPUT_BYTE = 48

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DATATYPES = [*DATATYPE_TO_NUMPY, "FP8", "", "fp32", "STRING"]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=40,
)
shapes = st.one_of(
    st.lists(st.integers(min_value=0, max_value=6), max_size=4),
    st.lists(st.integers(min_value=-2, max_value=2**40), max_size=5),
    json_values,
)
numbers = st.one_of(
    st.integers(min_value=-300, max_value=300),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)


def valid_values(datatype: str) -> st.SearchStrategy[Any]:
    if datatype == "BYTES":
        return st.text(max_size=4)
    if datatype == "BOOL":
        return st.booleans()
    dtype = DATATYPE_TO_NUMPY.get(datatype)
    if dtype is None:
        return numbers
    if dtype.kind == "f":
        width = {2: 16, 4: 32}.get(dtype.itemsize, 64)
        return st.one_of(
            st.floats(allow_nan=False, allow_infinity=False, width=width),  # type: ignore[arg-type]
            st.integers(-100, 100),
        )
    info = np.iinfo(dtype)
    return st.integers(int(info.min), int(info.max))


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, Any]:
    valid = draw(st.booleans())
    t: dict[str, Any] = {
        "name": draw(st.sampled_from(["x", "y"]))
        if valid
        else draw(st.one_of(st.text(min_size=1, max_size=12), json_values)),
        "datatype": draw(st.sampled_from(list(DATATYPE_TO_NUMPY) if valid else DATATYPES)),
        "shape": draw(st.lists(st.integers(0, 5), max_size=3) if valid else shapes),
    }
    kind = "valid" if valid else draw(st.sampled_from(["flat", "nested", "any", "none"]))
    shape = t["shape"]
    size = 0
    if isinstance(shape, list) and all(isinstance(d, int) and 0 <= d <= 6 for d in shape):
        size = math.prod(shape)
    if kind == "valid":
        flat = draw(st.lists(valid_values(t["datatype"]), min_size=size, max_size=size))
        if len(shape) >= 2 and size and draw(st.booleans()):
            arr = np.empty(size, dtype=object)
            arr[:] = flat
            flat = arr.reshape(shape).tolist()
        t["data"] = flat
    elif kind == "flat":
        t["data"] = draw(st.lists(numbers, min_size=size, max_size=size + 1))
    elif kind == "nested":
        row = draw(st.lists(numbers, min_size=1, max_size=4))
        t["data"] = [row] * draw(st.integers(min_value=1, max_value=4))
    elif kind == "any":
        t["data"] = draw(json_values)
    if draw(st.booleans()):
        t["parameters"] = draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3))
    return t


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {"inputs": draw(st.lists(tensors(), min_size=1, max_size=3))}
    if draw(st.booleans()):
        doc["parameters"] = draw(json_values)
    if draw(st.booleans()):
        doc["outputs"] = draw(json_values)
    if draw(st.booleans()):
        doc["id"] = draw(json_values)
    return doc


def dumps(doc: Any) -> bytes:
    """JSON with integers of any size (orjson stops at 64 bits)."""
    return json.dumps(doc).encode()


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, pos, value in edits:
        if not buf:
            break
        pos %= len(buf)
        if kind == 0:
            buf[pos] = value
        elif kind == 1:
            del buf[pos]
        else:
            buf.insert(pos, value)
    return bytes(buf)


edits = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6
)


def check(call: Callable[[], InferRequest], input_bytes: int) -> None:
    """The property: a valid decode or a 4xx RTServeError, within the memory budget."""
    tracemalloc.start()
    try:
        try:
            request = call()
        except RTServeError as exc:
            assert 400 <= exc.http_status < 500, exc
            assert len(exc.message) < 1000, exc.message[:200]
        else:
            for t in request.inputs:
                assert t.data.shape == t.shape
                assert t.data.dtype == DATATYPE_TO_NUMPY[t.datatype]
            assert sum(t.data.size for t in request.inputs) <= LIMITS.max_elements
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= BASE_BUDGET + PER_INPUT_BYTE * input_bytes, peak


def http(body: bytes, header_length: int | None = None) -> None:
    check(lambda: decode_infer_request(body, header_length, "m", "", LIMITS), len(body))


@FUZZ
@given(documents())
def test_random_v2_json_requests(doc: dict[str, Any]) -> None:
    http(dumps(doc))


@st.composite
def valid_tensors(draw: st.DrawFn) -> tuple[str, tuple[int, ...], list[Any], Any]:
    datatype = draw(st.sampled_from(list(DATATYPE_TO_NUMPY)))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    flat = draw(
        st.lists(valid_values(datatype), min_size=math.prod(shape), max_size=math.prod(shape))
    )
    data: Any = flat
    if len(shape) > 1 and draw(st.booleans()):
        arr = np.empty(len(flat), dtype=object)
        arr[:] = flat
        data = arr.reshape(shape).tolist()
    return datatype, shape, flat, data


@FUZZ
@given(valid_tensors())
def test_valid_json_tensors_decode_to_the_values_sent(
    case: tuple[str, tuple[int, ...], list[Any], Any],
) -> None:
    datatype, shape, flat, data = case
    body = dumps(
        {"inputs": [{"name": "x", "datatype": datatype, "shape": list(shape), "data": data}]}
    )
    (t,) = decode_infer_request(body, None, "m", "", LIMITS).inputs
    if datatype == "BYTES":
        expected = np.array([v.encode() for v in flat] or [b""], dtype=object)[: len(flat)]
    else:
        expected = np.array(flat, dtype=DATATYPE_TO_NUMPY[datatype])
    assert t.data.shape == shape
    np.testing.assert_array_equal(t.data.reshape(-1), expected)


@FUZZ
@given(documents(), edits)
def test_mutated_v2_json_requests(doc: dict[str, Any], changes: list[tuple[int, int, int]]) -> None:
    http(mutate(dumps(doc), changes))


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_as_a_json_body(body: bytes) -> None:
    http(body)


@st.composite
def binary_requests(draw: st.DrawFn) -> tuple[bytes, int]:
    inputs = []
    blobs = []
    for i in range(draw(st.integers(1, 3))):
        datatype = draw(st.sampled_from(DATATYPES))
        shape = draw(st.lists(st.integers(min_value=0, max_value=2**34), max_size=3))
        blob = draw(st.binary(max_size=64))
        if datatype == "BYTES" and draw(st.booleans()):
            items = draw(st.lists(st.binary(max_size=6), max_size=6))
            blob = b"".join(len(x).to_bytes(4, "little") + x for x in items)
            shape = [len(items)]
        size = draw(st.one_of(st.just(len(blob)), st.integers(-2, 100), json_values))
        inputs.append(
            {
                "name": f"in{i}",
                "datatype": datatype,
                "shape": shape,
                "parameters": {"binary_data_size": size},
            }
        )
        blobs.append(blob)
    header = dumps({"inputs": inputs})
    length = draw(st.one_of(st.just(len(header)), st.integers(-5, len(header) + 100)))
    return header + b"".join(blobs), length


@FUZZ
@given(binary_requests())
def test_random_binary_extension_requests(case: tuple[bytes, int]) -> None:
    body, length = case
    http(body, length)


def test_well_formed_binary_requests_decode_exactly() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    header = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 4],
                     "parameters": {"binary_data_size": x.nbytes}}]}
    )  # fmt: skip
    request = decode_infer_request(header + x.tobytes(), len(header), "m", "", LIMITS)
    np.testing.assert_array_equal(request.inputs[0].data, x)


@st.composite
def grpc_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=draw(st.text(max_size=20)), id=draw(st.text(max_size=5)))
    raw = draw(st.booleans())
    for i in range(draw(st.integers(0, 3))):
        datatype = draw(st.sampled_from(DATATYPES))
        shape = draw(
            st.lists(st.integers(min_value=-3, max_value=2**40), max_size=draw(st.integers(0, 4)))
        )
        t = msg.inputs.add(name=draw(st.text(max_size=8)) or f"i{i}", datatype=datatype)
        t.shape.extend(shape)
        if raw:
            msg.raw_input_contents.append(draw(st.binary(max_size=64)))
        else:
            c = t.contents
            c.int_contents.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8)))
            c.uint_contents.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=8)))
            c.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=8)))
            c.bool_contents.extend(draw(st.lists(st.booleans(), max_size=8)))
            c.bytes_contents.extend(draw(st.lists(st.binary(max_size=4), max_size=8)))
    return msg


@FUZZ
@given(grpc_requests())
def test_random_grpc_requests(msg: pb.ModelInferRequest) -> None:
    check(lambda: decode_model_infer(msg, LIMITS), msg.ByteSize())


@FUZZ
@given(grpc_requests(), edits)
def test_mutated_and_arbitrary_grpc_messages(
    msg: pb.ModelInferRequest, changes: list[tuple[int, int, int]]
) -> None:
    data = mutate(msg.SerializeToString(), changes)
    check(lambda: decode_model_infer(data, LIMITS), len(data))
