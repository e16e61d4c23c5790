"""Cache keys: a BLAKE2b-256 digest over a canonical, length-prefixed framing of a request.

What goes in, in this order: a format tag, the model name, the resolved version, the inputs
sorted by name (each: name, datatype, shape, raw bytes), and the requested output names in
request order (``None`` and an empty list both mean "every output"). Every
variable-length field is length-prefixed, so no two different requests frame to the same
bytes. The arrays are hashed through their buffers: no ``tolist``, no JSON.

Float inputs may be rounded to ``round_floats`` decimals first (feature vectors whose last
digits are noise then share an entry); ``-0.0`` is folded into ``0.0`` after rounding.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from rtserve.protocol.bytes_codec import encode_bytes_elements
from rtserve.protocol.types import DATATYPE_TO_NUMPY, ROW_PARAMETER, RequestedOutput, Tensor

KEY_FORMAT = b"rtserve-cache-key/1"
_FLOAT_DATATYPES = frozenset({"FP16", "FP32", "FP64"})
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def cache_key(
    model_name: str,
    version: str,
    inputs: Sequence[Tensor],
    outputs: Sequence[RequestedOutput] | None,
    round_floats: int | None = None,
) -> bytes:
    """The 32-byte digest that identifies this request's answer."""
    h = hashlib.blake2b(KEY_FORMAT, digest_size=32)
    update = h.update
    update(_str(model_name))
    update(_str(version))
    update(_U32.pack(len(inputs)))
    ordered = inputs if len(inputs) < 2 else sorted(inputs, key=_by_name)
    for t in ordered:
        update(_str(t.name))
        update(_str(t.datatype))
        shape = t.shape
        update(struct.pack(f"<I{len(shape)}q", len(shape), *shape))
        data = t.data
        if t.datatype == "BYTES":
            update(_U64.pack(data.size))
            update(encode_bytes_elements(data))
            continue
        if (
            round_floats is not None
            and t.datatype in _FLOAT_DATATYPES
            and not (t.parameters and t.parameters.get(ROW_PARAMETER))
        ):
            data = np.round(data, round_floats) + data.dtype.type(0.0)
        expected = DATATYPE_TO_NUMPY.get(t.datatype)
        if expected is not None and data.dtype != expected:
            data = data.astype(expected)
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        update(_U64.pack(data.nbytes))
        update(data.data)  # contiguous numeric buffer, hashed in place
    if not outputs:
        update(b"\xff")
    else:
        update(b"\x00")
        update(_U32.pack(len(outputs)))
        for o in outputs:
            update(_str(o.name))
        if any(o.classification for o in outputs):  # (appended: other keys are unchanged)
            update(b"\x01")
            update(struct.pack(f"<{len(outputs)}Q", *(o.classification for o in outputs)))
    return h.digest()


def _by_name(t: Tensor) -> str:
    return t.name


def _str(s: str) -> bytes:
    b = s.encode()
    return _U32.pack(len(b)) + b
