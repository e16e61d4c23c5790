"""V2 HTTP/REST codec: JSON tensors and the binary tensor data extension.

A request body is a JSON header, optionally followed by raw tensor bytes; the header's
length comes in the ``Inference-Header-Content-Length`` HTTP header. Binary inputs become
numpy arrays over the body without a copy.

Decoding is strict and budgeted (see :class:`~rtserve.protocol.limits.DecodeLimits`):
element counts are checked against the data actually present and the limits before any
allocation; a JSON header above a few KiB is checked for its number of lists and objects
before it is parsed; numeric ``data`` must hold JSON numbers in the datatype's range
(``null``, strings and booleans are refused, as are 1e39 for FP32 or -1 for UINT8).

JSON ``data`` lists become numpy arrays through ``struct`` (one C call packs the whole
list, refusing non-numbers and out-of-range values as it goes) and ``np.frombuffer``.

Non-finite floats in JSON outputs are written as the strings ``"NaN"``, ``"Infinity"``
and ``"-Infinity"`` (JSON has no such numbers; ``numpy`` and tritonclient read these
strings back as floats); FP inputs take the same strings, so an answer can be sent back.
"""

from __future__ import annotations

import math
import re
import struct
from itertools import chain
from typing import Any

import numpy as np
import orjson

from rtserve.errors import InvalidInput, PayloadTooLarge
from rtserve.protocol.bytes_codec import decode_bytes_elements, encode_bytes_elements
from rtserve.protocol.limits import (
    DEFAULT_LIMITS,
    MAX_ID_CHARS,
    MAX_NDIM,
    DecodeLimits,
    ElementBudget,
    check_bools,
    check_name,
    shown,
    shown_name,
)
from rtserve.protocol.shared_memory import (
    REGION,
    SharedMemoryRegions,
    disabled,
)
from rtserve.protocol.types import (
    DATATYPE_TO_NUMPY,
    InferRequest,
    InferResponse,
    RequestedOutput,
    Tensor,
    classification_count,
)

__all__ = [
    "decode_bytes_elements",
    "decode_infer_request",
    "encode_bytes_elements",
    "encode_infer_response",
]

_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY
# A JSON header this long or shorter is parsed without counting its containers first:
# at worst it holds ~2k lists, well under a millisecond of parsing.
_PRESCAN_BYTES = 4096
# struct format characters (native byte order, standard sizes) of the numeric datatypes.
_STRUCT_CODE = {
    "BOOL": "?",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}
_FLOATS = frozenset({"FP16", "FP32", "FP64"})
# A JSON boolean packs as 0.0 or 1.0: a float tensor holding neither bit pattern cannot
# have come from one, so the exact (slower) type check runs only when one occurs.
_ZERO_OR_ONE = {
    name: re.compile(
        re.escape(DATATYPE_TO_NUMPY[name].type(0).tobytes())
        + b"|"
        + re.escape(DATATYPE_TO_NUMPY[name].type(1).tobytes())
    )
    for name in _FLOATS
}
_CHUNK = 1 << 14
_structs: dict[tuple[str, int], struct.Struct] = {}


def _struct(code: str, n: int) -> struct.Struct:
    s = _structs.get((code, n))
    if s is None:
        if len(_structs) >= 256:
            _structs.clear()
        s = _structs[(code, n)] = struct.Struct(f"={n}{code}")
    return s


def _fail(where: str, message: str) -> InvalidInput:
    return InvalidInput(f"{where}: {message}")


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if type(value) is list and len(value) <= MAX_NDIM:
        for d in value:
            if type(d) is not int or d < 0:
                break
        else:
            return tuple(value)
    raise _fail(
        f"{where}.shape",
        f"expected a list of at most {MAX_NDIM} non-negative integers, got {shown(value)}",
    )


def _json_value(v: Any) -> str:
    """A parsed JSON value as the client wrote it (``null``, ``"0.5"``, ``true``), cut short."""
    try:
        return shown(orjson.dumps(v).decode())
    except TypeError:
        return shown(v)


def _flat_list(data: Any, ndim: int, count: int, where: str) -> list[Any]:
    """The leaves of (nested) ``data`` in row-major order, nested at most ``ndim`` deep;
    stops as soon as there are more than ``count``."""
    if type(data) is not list:
        return [data]
    max_depth = max(ndim, 1)
    out: list[Any] = []
    stack: list[tuple[list[Any], int, int]] = [(data, 0, 1)]
    while stack:
        items, start, depth = stack.pop()
        for i in range(start, len(items)):
            item = items[i]
            if type(item) is list:
                if depth >= max_depth:
                    raise _fail(
                        f"{where}.data",
                        f"nested deeper than the tensor's {ndim} dimension(s)",
                    )
                stack.append((items, i + 1, depth))
                stack.append((item, 0, depth + 1))
                break
            out.append(item)
            if len(out) > count:
                raise _fail(f"{where}.data", f"has more than the {count} elements of its shape")
    return out


def _bad_element(flat: list[Any], datatype: str, where: str) -> InvalidInput:
    """Why ``flat`` does not pack as ``datatype``: the first offending element."""
    code = _STRUCT_CODE[datatype]
    one = _struct(code, 1)
    kind = (
        "booleans"
        if datatype == "BOOL"
        else (f"{datatype} numbers" if datatype in _FLOATS else f"{datatype} integers")
    )
    for i, v in enumerate(flat):
        if datatype == "BOOL":
            ok_type = type(v) is bool
        elif datatype in _FLOATS:
            ok_type = type(v) is float or type(v) is int
        else:
            ok_type = type(v) is int
        if not ok_type:
            return _fail(f"{where}.data[{i}]", f"expected {kind}, got {_json_value(v)}")
        try:
            one.pack(v)
        except (struct.error, OverflowError, TypeError):
            info = np.iinfo if datatype not in _FLOATS else np.finfo
            dt = DATATYPE_TO_NUMPY[datatype]
            lo, hi = info(dt).min, info(dt).max
            return _fail(
                f"{where}.data[{i}]",
                f"{_json_value(v)} is out of range for {datatype} ({lo} to {hi})",
            )
    return _fail(f"{where}.data", f"expected {kind}")


_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _pack(
    flat: list[Any], datatype: str, where: str, header: tuple[bytes, int] | None = None
) -> np.ndarray[Any, Any]:
    """Pack a flat list of JSON values into a numpy array of ``datatype``, strictly.

    ``header``: the JSON text (body, length) the values came from; when it holds no
    ``true``/``false`` token, no value can be a boolean and the type check is skipped."""
    code = _STRUCT_CODE[datatype]
    dtype = DATATYPE_TO_NUMPY[datatype]
    n = len(flat)
    suspect = False
    if datatype == "BOOL" and not {*map(type, flat)} <= {bool}:
        raise _bad_element(flat, datatype, where)
    try:
        if n <= _CHUNK:
            buf = _struct(code, n).pack(*flat)
            arr = np.frombuffer(bytearray(buf), dtype=dtype)  # writable, as before
            if datatype in _FLOATS:
                suspect = _ZERO_OR_ONE[datatype].search(buf) is not None
            else:
                suspect = datatype != "BOOL"
        else:
            arr = np.empty(n, dtype=dtype)
            out = arr.data.cast("B")
            step = _struct(code, _CHUNK)
            size = dtype.itemsize
            for i in range(0, n - _CHUNK + 1, _CHUNK):
                step.pack_into(out, i * size, *flat[i : i + _CHUNK])
            rest = n % _CHUNK
            if rest:
                _struct(code, rest).pack_into(out, (n - rest) * size, *flat[n - rest :])
            suspect = datatype != "BOOL" and bool(((arr == 0) | (arr == 1)).any())
    except (struct.error, OverflowError, TypeError):
        if datatype in _FLOATS and any(type(v) is str for v in flat):
            # "NaN" / "Infinity" / "-Infinity", as JSON answers spell them: read back
            fixed = [_NON_FINITE.get(v, v) if type(v) is str else v for v in flat]
            if not any(type(v) is str for v in fixed):
                return _pack(fixed, datatype, where, header)
        raise _bad_element(flat, datatype, where) from None
    # JSON true/false pack as 1/0: only when such values occur, look at the types.
    if suspect and header is not None:
        body, end = header
        suspect = body.find(b"true", 0, end) >= 0 or body.find(b"false", 0, end) >= 0
    if suspect and bool in {*map(type, flat)}:
        raise _bad_element(flat, datatype, where)
    return arr


def _json_array(
    data: Any,
    datatype: str,
    shape: tuple[int, ...],
    count: int,
    where: str,
    header: tuple[bytes, int] | None = None,
) -> np.ndarray[Any, Any]:
    if datatype == "BYTES":
        flat = _flat_list(data, len(shape), count, where)
        if len(flat) != count:
            raise _fail(
                f"{where}.data", f"has {len(flat)} elements, shape {list(shape)} needs {count}"
            )
        arr = np.empty(count, dtype=object)
        for i, item in enumerate(flat):
            if type(item) is not str:
                raise _fail(
                    f"{where}.data[{i}]", f"BYTES elements must be strings, got {_json_value(item)}"
                )
            arr[i] = item.encode()
        return arr.reshape(shape)
    if type(data) is list and len(data) == count and count:
        # The common case, a flat list: nested lists inside fail to pack and are diagnosed.
        try:
            return _pack(data, datatype, where, header).reshape(shape)
        except InvalidInput:
            if not any(type(v) is list for v in data):
                raise
    unnested = _unnest(data, len(shape), count)
    if unnested is None or len(unnested) != count:
        unnested = _flat_list(data, len(shape), count, where)
    flat = unnested
    if len(flat) != count:
        raise _fail(f"{where}.data", f"has {len(flat)} elements, shape {list(shape)} needs {count}")
    return _pack(flat, datatype, where, header).reshape(shape)


def _unnest(data: Any, ndim: int, count: int) -> list[Any] | None:
    """Fully nested ``data`` flattened level by level in C; None when it is not a list of
    lists down to the last level (then :func:`_flat_list` walks it)."""
    level = data
    if type(level) is not list:
        return None
    for _ in range(ndim - 1):
        if len(level) == 1 and type(level[0]) is list:
            level = level[0]  # one row: no copy
            continue
        if len(level) > count or {*map(type, level)} != {list}:
            return None
        level = list(chain.from_iterable(level))
    return level


def _check_parameters(value: Any, where: str, limits: DecodeLimits) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"expected an object, got {_json_value(value)}")
    if value:
        stack: list[tuple[Any, int]] = [(value, 1)]
        while stack:
            obj, depth = stack.pop()
            if depth > limits.max_json_depth:
                raise _fail(
                    where, f"nested deeper than {limits.max_json_depth} levels (max_json_depth)"
                )
            children = obj.values() if isinstance(obj, dict) else obj
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return value


def _prescan(body: bytes, header_length: int, limits: DecodeLimits) -> None:
    """Bound the parse: count the header's lists and objects (an over-count: brackets
    inside strings count too) and its commas before orjson builds them.

    Each one counted is a byte of the header, so a header no longer than a limit cannot
    exceed it, and is not scanned for it: a model's usual request (the benchmark MLP's is
    ~5 kB against its 8,192 elements) skips both scans, ~1 µs each per kB."""
    commas_checked = header_length > limits.max_elements + 1024
    if header_length <= limits.max_json_containers and not commas_checked:
        return
    containers = body.count(b"[", 0, header_length) + body.count(b"{", 0, header_length)
    if containers > limits.max_json_containers:
        raise PayloadTooLarge(
            f"request JSON: more than {limits.max_json_containers} lists and objects "
            "(max_json_containers); send large tensors as flat data lists or binary data"
        )
    if not commas_checked:
        return
    commas = body.count(b",", 0, header_length)
    if commas > limits.max_elements + containers + 1024:  # slack: keys, parameters
        raise PayloadTooLarge(
            f"request JSON: more than {limits.max_elements} values (max_elements)"
        )


_FAST_KEYS = frozenset({"name", "shape", "datatype", "data"})


def _fast_inputs(
    raw_inputs: list[Any], limits: DecodeLimits, header: tuple[bytes, int]
) -> list[Tensor] | None:
    """The common request (JSON only; each input exactly name, shape, numeric datatype and
    a flat data list of the right length, nothing else) decoded without building any error
    context. None: anything else or anything wrong — the full decoder then checks it
    again and names the problem."""
    inputs: list[Tensor] = []
    elements = 0
    for item in raw_inputs:
        if type(item) is not dict or item.keys() != _FAST_KEYS:
            return None
        name = item["name"]
        datatype = item["datatype"]
        shape = item["shape"]
        data = item["data"]
        if (
            type(name) is not str
            or not 0 < len(name) <= 1024
            or type(datatype) is not str
            or datatype not in _STRUCT_CODE
            or type(shape) is not list
            or not 0 < len(shape) <= MAX_NDIM
            or type(data) is not list
        ):
            return None
        count = 1
        for d in shape:
            if type(d) is not int or d < 0:
                return None
            count *= d
        elements += count
        if elements > limits.max_elements or count == 0 or len(data) != count:
            return None
        try:
            arr = _pack(data, datatype, "", header)
        except InvalidInput:
            return None
        dims = tuple(shape)
        inputs.append(Tensor(name, datatype, dims, arr.reshape(dims)))
    return inputs


def json_header_length(value: bytes | None) -> int | None:
    """The ``Inference-Header-Content-Length`` header (binary tensor extension): the JSON
    part's length, or None when the header is absent (the body is all JSON)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidInput(
            f"Inference-Header-Content-Length: expected an integer, got {value[:40]!r}"
        ) from None


def decode_infer_request(
    body: bytes,
    header_length: int | None,
    model_name: str,
    model_version: str,
    limits: DecodeLimits = DEFAULT_LIMITS,
    shm: SharedMemoryRegions | None = None,
) -> InferRequest:
    """Decode a V2 inference request body; raises InvalidInput / PayloadTooLarge (4xx).

    ``shm``: the registered system shared memory regions (None: the extension is off, and
    a tensor that names a region is refused)."""
    if header_length is None:
        header_length = len(body)
    doc = _json_header(body, header_length, limits)
    raw_inputs = doc.get("inputs")
    if type(raw_inputs) is not list or not raw_inputs:
        raise InvalidInput("inputs: expected a non-empty list of tensors")
    if header_length == len(body) and len(doc) == 1:
        fast = _fast_inputs(raw_inputs, limits, (body, header_length))
        if fast is not None:
            return InferRequest(model_name, model_version, fast)
    binary = memoryview(body)[header_length:]
    offset = 0
    budget = ElementBudget(limits)
    inputs: list[Tensor] = []
    for i, item in enumerate(raw_inputs):
        tensor, used = _input(item, i, binary[offset:], budget, limits, shm, (body, header_length))
        inputs.append(tensor)
        offset += used
    if offset != len(binary):
        raise InvalidInput(
            f"binary data: {len(binary) - offset} bytes after the last input's binary_data_size"
        )
    params = doc.get("parameters")
    params = {} if params is None else _check_parameters(params, "parameters", limits)
    if "binary_data_output" in params and type(params["binary_data_output"]) is not bool:
        raise _fail("parameters.binary_data_output", "expected true or false")
    raw_outputs = doc.get("outputs")
    outputs = None if raw_outputs is None else _requested_outputs(raw_outputs, limits, shm)
    req_id = doc.get("id", "")
    return InferRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=inputs,
        outputs=outputs,
        id=check_name(req_id if type(req_id) is str else str(req_id), "id", MAX_ID_CHARS),
        parameters=params,
    )


def _json_header(body: bytes, header_length: int, limits: DecodeLimits) -> dict[str, Any]:
    """The JSON object at the head of the body (all of it without binary data)."""
    if header_length < 0 or header_length > len(body):
        raise InvalidInput(
            f"Inference-Header-Content-Length: {header_length} is outside the body of "
            f"{len(body)} bytes"
        )
    if header_length > _PRESCAN_BYTES:
        _prescan(body, header_length, limits)
    try:
        doc = orjson.loads(memoryview(body)[:header_length] if header_length != len(body) else body)
    except orjson.JSONDecodeError as exc:
        if header_length != len(body):
            raise InvalidInput(
                f"the JSON header (the first {header_length} bytes, as "
                f"Inference-Header-Content-Length says) is not valid JSON: {shown(str(exc), 200)}"
            ) from None
        raise InvalidInput(f"request body is not valid JSON: {shown(str(exc), 200)}") from None
    if type(doc) is not dict:
        raise InvalidInput("request body: expected a JSON object with an 'inputs' list")
    return doc


def _input(
    item: Any,
    i: int,
    binary: memoryview,
    budget: ElementBudget,
    limits: DecodeLimits,
    shm: SharedMemoryRegions | None,
    source: tuple[bytes, int],
) -> tuple[Tensor, int]:
    """One tensor of ``inputs`` and the count of binary bytes it took from ``binary``."""
    where = f"inputs[{i}]"
    if type(item) is not dict:
        raise _fail(where, "expected an object with name, shape, datatype and data")
    name = item.get("name")
    if type(name) is not str or not name:
        raise _fail(f"{where}.name", f"expected a non-empty string, got {_json_value(name)}")
    check_name(name, f"{where}.name")
    where = f"input {shown_name(name)}"
    datatype = item.get("datatype")
    dtype = DATATYPE_TO_NUMPY.get(datatype) if type(datatype) is str else None
    if dtype is None:
        raise _fail(
            f"{where}.datatype",
            f"expected one of {', '.join(DATATYPE_TO_NUMPY)}, got {_json_value(datatype)}",
        )
    assert isinstance(datatype, str)
    shape = _shape(item.get("shape"), where)
    count = math.prod(shape)
    budget.charge(where, shape, count, datatype == "BYTES")
    params = item.get("parameters")
    size = None
    if params is not None:
        params = _check_parameters(params, f"{where}.parameters", limits)
        size = params.get("binary_data_size")
        if REGION in params:
            if "data" in item or size is not None:
                raise _fail(
                    where,
                    f"has parameters.{REGION} and also "
                    f"{'data' if 'data' in item else 'parameters.binary_data_size'} "
                    "(send one)",
                )
            if shm is None:
                raise disabled(where)
            arr = shm.read_input(params, datatype, shape, count, where, limits.max_bytes_elements)
            return Tensor(name, datatype, shape, arr), 0
    if size is not None:
        if "data" in item:
            raise _fail(where, "has both 'data' and parameters.binary_data_size (send one)")
        arr = _binary_tensor(size, binary, datatype, dtype, shape, count, where, limits)
        return Tensor(name, datatype, shape, arr), size
    if "data" not in item:
        raise _fail(where, "has neither 'data' nor parameters.binary_data_size")
    arr = _json_array(item["data"], datatype, shape, count, where, source)
    return Tensor(name, datatype, shape, arr), 0


def _binary_tensor(
    size: Any,
    binary: memoryview,
    datatype: str,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    count: int,
    where: str,
    limits: DecodeLimits,
) -> np.ndarray[Any, Any]:
    """The tensor in the first ``size`` bytes of ``binary``."""
    if type(size) is not int or size < 0:
        raise _fail(
            f"{where}.parameters.binary_data_size",
            f"expected a byte count, got {_json_value(size)}",
        )
    if size > len(binary):
        raise _fail(
            f"{where}.parameters.binary_data_size",
            f"{size} bytes requested but only {len(binary)} binary bytes remain",
        )
    chunk = binary[:size]
    if datatype == "BYTES":
        return decode_bytes_elements(chunk, count, where, limits.max_bytes_elements).reshape(shape)
    expected = count * dtype.itemsize
    if size != expected:
        raise _fail(
            f"{where}.parameters.binary_data_size",
            f"{size} bytes do not match shape {list(shape)} of {datatype} ({expected} bytes)",
        )
    arr = np.frombuffer(chunk, dtype=dtype, count=count).reshape(shape)
    if datatype == "BOOL":
        check_bools(arr, where, "binary data holds bytes")
    if not arr.flags.aligned:
        arr = arr.copy()
    return arr


def _requested_outputs(
    raw_outputs: Any, limits: DecodeLimits, shm: SharedMemoryRegions | None
) -> list[RequestedOutput]:
    if type(raw_outputs) is not list:
        raise InvalidInput("outputs: expected a list of {name, parameters}")
    outputs = []
    for i, out in enumerate(raw_outputs):
        if type(out) is not dict or type(out.get("name")) is not str:
            raise InvalidInput(f"outputs[{i}].name: expected a string")
        check_name(out["name"], f"outputs[{i}].name")
        op = out.get("parameters")
        flag = None
        top = 0
        region = None
        if op is not None:
            op = _check_parameters(op, f"outputs[{i}].parameters", limits)
            flag = op.get("binary_data")
            if flag is not None and type(flag) is not bool:
                raise _fail(f"outputs[{i}].parameters.binary_data", "expected true or false")
            if "classification" in op:
                where = f"outputs[{i}].parameters.classification"
                top = classification_count(op["classification"], where)
            if REGION in op:
                where = f"output {shown_name(out['name'])}"
                if shm is None:
                    raise disabled(where)
                if flag is True or top:
                    other = "binary_data: true" if flag is True else "classification"
                    raise _fail(where, f"has parameters.{REGION} and {other} (send one)")
                region = shm.output_region(op, where)
        outputs.append(
            RequestedOutput(out["name"], flag if type(flag) is bool else None, top, region)
        )
    return outputs


def _non_finite_as_strings(arr: np.ndarray[Any, Any]) -> list[Any]:
    out: list[Any] = arr.reshape(-1).tolist()
    for i, v in enumerate(out):
        if v != v:
            out[i] = "NaN"
        elif v in (math.inf, -math.inf):
            out[i] = "Infinity" if v > 0 else "-Infinity"
    return out


def encode_infer_response(
    response: InferResponse,
    request: InferRequest,
    in_shared_memory: dict[str, dict[str, Any]] | None = None,
) -> tuple[bytes, int | None]:
    """The response body and, when it carries binary tensors, the JSON header's length.

    ``in_shared_memory``: the outputs already written into shared memory regions, by name:
    each is answered with its name, datatype and shape only, as Triton does (Triton's C++
    client reads any output ``parameters`` as binary data's)."""
    binary_default = request.parameters.get("binary_data_output") is True
    flags: dict[str, bool | None] = (
        {o.name: o.binary for o in request.outputs} if request.outputs else {}
    )
    blobs: list[bytes] = []
    outs: list[dict[str, Any]] = []
    for t in response.outputs:
        arr = t.data
        flag = flags.get(t.name)
        as_binary = binary_default if flag is None else flag
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": arr.shape}
        if in_shared_memory is not None and t.name in in_shared_memory:
            outs.append(entry)  # in shared memory: no data, no parameters (as Triton)
            continue
        if as_binary:
            blob = (
                encode_bytes_elements(arr)
                if t.datatype == "BYTES"
                else np.ascontiguousarray(arr).tobytes()
            )
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif t.datatype == "BYTES":
            entry["data"] = [
                b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b)
                for b in arr.reshape(-1)
            ]
        else:
            entry["data"] = np.ascontiguousarray(arr).reshape(-1)
        outs.append(entry)
    doc: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "outputs": outs,
    }
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = response.parameters
    header = orjson.dumps(doc, option=_JSON_OPTS)
    if b"null" in header:
        # orjson writes NaN and infinities as null: spell them out instead.
        for entry in outs:
            data = entry.get("data")
            if (
                isinstance(data, np.ndarray)
                and data.dtype.kind == "f"
                and not bool(np.isfinite(data).all())
            ):
                entry["data"] = _non_finite_as_strings(data)
        header = orjson.dumps(doc, option=_JSON_OPTS)
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)
