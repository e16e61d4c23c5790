"""OpenAI's ``/v1/embeddings`` over a tensor model, without a transport.

A model answers embeddings when its signature reads as one of two shapes:

- **text in, vector out**: one BYTES input of one element per row and one float output of
  one dimension per row (the ``text-embedding`` pipeline: tokenizer step, encoder, pooling
  and normalisation in the graph). Strings go in as they are.
- **token ids in, vector out**: an encoder whose inputs are ``input_ids`` and
  ``attention_mask`` (and optionally ``token_type_ids``), integers of any length per row,
  and one float output of one dimension per row (pooled in the graph). Token ids go in
  padded to the longest with the mask; text needs a ``tokenizer.json`` in the version's
  directory.

- **token ids in, token states out**: an encoder whose config has an ``embedding:`` section
  (``runtime/pooling.py``): its ``[batch, seq, hidden]`` output is pooled here (masked
  mean, first token or last real token) and L2-normalised when the section says so; a
  request's ``dimensions`` may ask one of the section's smaller sizes (truncated, then
  renormalised). Rows are padded to a multiple of 8 tokens, so that texts of similar
  lengths share a batch.

Each request is submitted through the dataplane as a V2 request of as many rows as it has
inputs (split at the model's ``max_batch_size``), so it is batched by the model's dynamic
batcher with every other request and answers the very vectors of ``/v2/.../infer``.
``usage.prompt_tokens`` counts the tokens of the model's tokenizer (an ensemble's first
step's ``tokenizer.json``); token ids given to a text model are decoded by it first.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from rtserve.core.dataplane import DataPlane
from rtserve.core.model import ModelVersion
from rtserve.errors import InvalidInput, RTServeError, as_error
from rtserve.protocol.types import InferRequest, Tensor, Timings
from rtserve.runtime.pooling import EmbeddingSection, normalized, pool

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
MAX_INPUT_CHARS = 1 << 16
MAX_INPUT_TOKENS = 8192
TEXT, IDS, POOLED = "text", "ids", "pooled"
PAD_TO = 8  # (POOLED) row widths rounded up to a multiple of this: more requests per batch
_FLOATS = ("FP32", "FP16", "FP64", "BF16")
_INT = ("INT64", "INT32")


@dataclasses.dataclass(slots=True)
class EmbeddingRequest:
    model: str
    inputs: list[str] | list[list[int]]
    base64: bool = False
    dimensions: int | None = None


@dataclasses.dataclass(slots=True)
class Embedder:
    """How one model version is asked for embeddings."""

    kind: str  # TEXT | IDS | POOLED
    input: str  # TEXT: the BYTES input; IDS, POOLED: the token ids input
    output: str
    dims: int
    max_batch: int
    tokenizer: Any = None  # a ``tokenizers.Tokenizer`` (None: token counts unknown)
    extra: tuple[str, ...] = ()  # IDS, POOLED: the mask and "token_type_ids" inputs fed
    section: EmbeddingSection | None = None  # POOLED: how its token states are pooled


def _fail(field: str, expected: str, value: Any) -> InvalidInput:
    return InvalidInput(f"{field}: expected {expected}, got {repr(value)[:60]}")


def parse(body: bytes) -> EmbeddingRequest:
    """An embeddings request; errors name the field and what was expected."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidInput("request body: not valid JSON") from None
    if not isinstance(doc, dict):
        raise InvalidInput("request body: expected a JSON object with model and input")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("model", "the name of a served embedding model (a string)", model)
    fmt = doc.get("encoding_format", "float")
    if fmt not in ("float", "base64", None):
        raise _fail("encoding_format", '"float" or "base64"', fmt)
    dims = doc.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise _fail("dimensions", "an integer >= 1", dims)
    user = doc.get("user")
    if user is not None and not isinstance(user, str):
        raise _fail("user", "a string", user)
    return EmbeddingRequest(model, _inputs(doc.get("input")), fmt == "base64", dims)


def _inputs(value: Any) -> list[str] | list[list[int]]:
    expected = (
        f"a non-empty string, a list of at most {MAX_INPUTS} strings, a list of token ids "
        "or a list of such lists"
    )
    one_list = isinstance(value, list) and value and all(type(t) is int for t in value)
    if isinstance(value, str) or one_list:
        value = [value]
    if not isinstance(value, list) or not value or len(value) > MAX_INPUTS:
        raise _fail("input", expected, value)
    if all(isinstance(v, str) for v in value):
        for i, text in enumerate(value):
            if not text or len(text) > MAX_INPUT_CHARS:
                raise _fail(f"input[{i}]", f"a string of 1-{MAX_INPUT_CHARS} characters", text)
        return value
    for i, ids in enumerate(value):
        if (
            not isinstance(ids, list)
            or not ids
            or len(ids) > MAX_INPUT_TOKENS
            or any(type(t) is not int or not 0 <= t < 1 << 31 for t in ids)
        ):
            raise _fail(f"input[{i}]", f"a list of 1-{MAX_INPUT_TOKENS} token ids", ids)
    return value


# ---------------------------------------------------------------------- models
_EMBEDDERS: dict[int, tuple[ModelVersion, Embedder | RTServeError | None]] = {}


def _generative(mv: ModelVersion) -> bool:
    """Whether ``mv`` is more than a tensor model (a generative one)."""
    return getattr(mv, "llm", None) is not None or bool(getattr(mv, "capabilities", None))


def _vector(mv: ModelVersion) -> tuple[str, int] | None:
    outputs = list(mv.outputs.values())
    if len(outputs) != 1:
        return None
    out = outputs[0]
    if out.datatype not in _FLOATS or len(out.shape) != 1 or out.shape[0] < 1:
        return None
    return out.name, out.shape[0]


def _version_dir(mv: ModelVersion) -> Path | None:
    if not mv.config.source:
        return None
    return Path(mv.config.source).parent / mv.version


def _load_tokenizer(directory: Path | None, file: str = "tokenizer.json") -> Any:
    if directory is None or not (directory / file).is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    tokenizer = Tokenizer.from_file(str(directory / file))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def embedder(dataplane: DataPlane, mv: ModelVersion) -> Embedder | None:
    """How ``mv`` answers embeddings (None: it is not an embedding model); cached. A model
    whose ``embedding:`` section does not fit its signature raises, saying why."""
    cached = _EMBEDDERS.get(id(mv))
    if cached is None or cached[0] is not mv:
        # (a miss: versions unloaded since the last one are dropped, so the cache holds no
        # unloaded model alive)
        live = {id(v) for v in dataplane.registry.loaded_versions()}
        for key in [k for k in _EMBEDDERS if k not in live]:
            del _EMBEDDERS[key]
        try:
            found: Embedder | RTServeError | None = _embedder(dataplane, mv)
        except RTServeError as exc:
            found = exc
        cached = _EMBEDDERS[id(mv)] = (mv, found)
    if isinstance(cached[1], RTServeError):
        raise cached[1]
    return cached[1]


def _embedder(dataplane: DataPlane, mv: ModelVersion) -> Embedder | None:
    if _generative(mv):
        return None
    if mv.config.embedding is not None:
        return _pooled(mv, mv.config.embedding)
    vector = _vector(mv)
    if vector is None:
        return None
    output, dims = vector
    inputs = mv.inputs
    batch = mv.config.max_batch_size if mv.config.max_batch_size > 0 else 32
    if len(inputs) == 1:
        ((name, spec),) = inputs.items()
        if spec.datatype != "BYTES" or tuple(spec.shape) not in ((1,), ()):
            return None
        return Embedder(TEXT, name, output, dims, batch, _text_tokenizer(dataplane, mv))
    names = set(inputs)
    if (
        "input_ids" in names
        and "attention_mask" in names
        and names
        <= {
            "input_ids",
            "attention_mask",
            "token_type_ids",
        }
    ):
        if any(s.datatype not in _INT or len(s.shape) != 1 for s in inputs.values()):
            return None
        extra = tuple(n for n in ("attention_mask", "token_type_ids") if n in names)
        return Embedder(
            IDS, "input_ids", output, dims, batch, _load_tokenizer(_version_dir(mv)), extra
        )
    return None


def _pooled(mv: ModelVersion, section: EmbeddingSection) -> Embedder:
    """The embedder of a model with an ``embedding:`` section, checked against its signature."""

    def misfit(field: str, expected: str) -> RTServeError:
        return RTServeError(
            f"model '{mv.name}': {mv.config.source}: embedding.{field}: {expected} "
            "(fix the model's config.yaml)"
        )

    if mv.config.max_batch_size <= 0:
        raise misfit("input", "a model that batches (max_batch_size > 0)")
    inputs = mv.inputs
    for field, name in (("input", section.input), ("mask", section.mask)):
        spec = inputs.get(name) if name else None
        if name and (spec is None or spec.datatype not in _INT or len(spec.shape) != 1):
            raise misfit(
                field,
                f"an integer input of one dimension per row named {name!r} (the model's "
                f"inputs: {', '.join(sorted(inputs))})",
            )
    extra = tuple(n for n in (section.mask, "token_type_ids") if n and n in inputs)
    others = set(inputs) - {section.input, *extra}
    if others:
        raise misfit(
            "input", f"inputs the section names (the model also takes {', '.join(sorted(others))})"
        )
    names = [section.output] if section.output else list(mv.outputs)
    out = mv.outputs.get(names[0]) if len(names) == 1 else None
    if out is None or out.datatype not in _FLOATS or len(out.shape) != 2 or out.shape[1] < 1:
        raise misfit(
            "output",
            "a float output of [seq, hidden] per row with a known hidden size (the model's "
            f"outputs: {', '.join(f'{o.name} {list(o.shape)}' for o in mv.outputs.values())})",
        )
    dims = out.shape[1]
    if any(d >= dims for d in section.dimensions):
        raise misfit("dimensions", f"sizes under the model's {dims}")
    model_dir = Path(mv.config.source).parent if mv.config.source else None
    if section.tokenizer:
        assert model_dir is not None
        where = model_dir / section.tokenizer
        try:
            tokenizer = (
                _load_tokenizer(where)
                if where.is_dir()
                else _load_tokenizer(where.parent, where.name)
            )
        except Exception as exc:  # (a file the tokenizers library cannot read)
            raise misfit("tokenizer", f"a tokenizers JSON file ({exc})") from None
        if tokenizer is None:
            raise misfit("tokenizer", f"a tokenizer.json file or a directory holding one: {where}")
    else:
        tokenizer = _load_tokenizer(_version_dir(mv)) or _load_tokenizer(model_dir)
    batch = mv.config.max_batch_size
    return Embedder(POOLED, section.input, out.name, dims, batch, tokenizer, extra, section)


def _text_tokenizer(dataplane: DataPlane, mv: ModelVersion) -> Any:
    """The tokenizer of a text model: its own ``tokenizer.json``, or its first step's."""
    own = _load_tokenizer(_version_dir(mv))
    if own is not None or not mv.config.steps:
        return own
    first = mv.config.steps[0]
    model = first.get("model") if isinstance(first, dict) else getattr(first, "model", None)
    if not isinstance(model, str):
        return None
    try:
        step = dataplane.registry.get_loaded(model)
    except RTServeError:
        return None
    return _load_tokenizer(_version_dir(step))


def embedding_models(dataplane: DataPlane) -> list[tuple[str, int]]:
    """(name, dimensions) of the ready models that answer embeddings."""
    out: dict[str, int] = {}
    for mv in dataplane.registry.loaded_versions():
        if mv.ready and not _generative(mv):
            try:
                found = embedder(dataplane, mv)
            except RTServeError:  # (a section that does not fit: said when it is asked)
                continue
            if found is not None:
                out.setdefault(mv.name, found.dims)
    return sorted(out.items())


# ---------------------------------------------------------------------- answers
def _rows(em: Embedder, inputs: list[str] | list[list[int]]) -> tuple[list[Any], int]:
    """The rows to send (strings or id lists) and the prompt's tokens."""
    tok = em.tokenizer
    if tok is not None and not isinstance(inputs[0], str):
        _check_vocabulary(inputs, tok.get_vocab_size())  # type: ignore[arg-type]
    if em.kind == TEXT:
        if isinstance(inputs[0], str):
            texts: list[str] = inputs  # type: ignore[assignment]
            if tok is None:
                return texts, 0
            return texts, sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=True))
        if tok is None:
            raise InvalidInput(
                "input: expected strings (this model has no tokenizer.json to read token ids)"
            )
        ids_rows: list[list[int]] = inputs  # type: ignore[assignment]
        texts = tok.decode_batch(ids_rows, skip_special_tokens=True)
        return texts, sum(len(r) for r in ids_rows)
    if isinstance(inputs[0], str):
        if tok is None:
            raise InvalidInput(
                "input: expected token ids (this model has no tokenizer.json to read text)"
            )
        rows = [e.ids for e in tok.encode_batch(inputs, add_special_tokens=True)]
    else:
        rows = list(inputs)
    if em.section is not None:
        limit = em.section.max_length
        for i, r in enumerate(rows):
            if len(r) > limit:
                raise InvalidInput(
                    f"input[{i}]: expected at most {limit} tokens (this model's "
                    f"embedding.max_length), got {len(r)}"
                )
    return rows, sum(len(r) for r in rows)


def _check_vocabulary(rows: list[list[int]], vocab: int) -> None:
    """Token ids the tokenizer knows (an unknown one would be dropped from the text, or
    fail deep in the model)."""
    for i, ids in enumerate(rows):
        for j, token in enumerate(ids):
            if token >= vocab:
                raise InvalidInput(
                    f"input[{i}]: token {j} is {token}, expected ids in [0, {vocab}) (the "
                    "model's vocabulary)"
                )


def _request(em: Embedder, mv: ModelVersion, rows: list[Any]) -> InferRequest:
    if em.kind == TEXT:
        data = np.empty((len(rows), 1), dtype=object)
        for i, text in enumerate(rows):
            data[i, 0] = text.encode()
        return InferRequest(mv.name, mv.version, [Tensor(em.input, "BYTES", data.shape, data)])
    ids, mask = _padded(em, rows)
    spec = mv.inputs[em.input]
    ids = ids.astype(np.int64 if spec.datatype == "INT64" else np.int32, copy=False)
    tensors = [Tensor(em.input, spec.datatype, ids.shape, ids)]
    mask_name = em.section.mask if em.section is not None else "attention_mask"
    for name in em.extra:
        spec = mv.inputs[name]
        data = mask if name == mask_name else np.zeros_like(mask)
        data = data.astype(np.int64 if spec.datatype == "INT64" else np.int32, copy=False)
        tensors.append(Tensor(name, spec.datatype, data.shape, data))
    return InferRequest(mv.name, mv.version, tensors)


def _padded(em: Embedder, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The rows' token ids right-padded with 0 and their attention mask (int64)."""
    width = max(len(r) for r in rows)
    if em.kind == POOLED:
        width = -(-width // PAD_TO) * PAD_TO
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


def _prepared(
    dataplane: DataPlane, request: EmbeddingRequest, timings: Timings
) -> tuple[ModelVersion, Embedder, list[Any], int]:
    mv = dataplane.resolve(request.model, "", timings)
    em = embedder(dataplane, mv)
    if em is None:
        raise InvalidInput(
            f"model: '{mv.name}' is not an embedding model (expected one text input and one "
            "vector output, or input_ids and attention_mask in and one vector out)"
        )
    asked = request.dimensions
    sizes = em.section.dimensions if em.section is not None else ()
    if asked is not None and asked != em.dims and asked not in sizes:
        allowed = " or ".join(str(d) for d in (*sizes, em.dims))
        raise InvalidInput(f"dimensions: this model answers {allowed} dimensions, got {asked}")
    rows, tokens = _rows(em, request.inputs)
    return mv, em, rows, tokens


async def embed(
    dataplane: DataPlane, request: EmbeddingRequest, timings: Timings
) -> dict[str, Any]:
    """The ``/v1/embeddings`` answer: the rows through the dataplane, at most
    ``max_batch_size`` per V2 request (each recorded as one)."""
    try:
        mv, em, rows, tokens = _prepared(dataplane, request, timings)
    except Exception as exc:  # (recorded here: it never reached the dataplane)
        dataplane.record_refusal(timings, as_error(exc, "embeddings request"), request.model)
        raise
    parts = [rows[i : i + em.max_batch] for i in range(0, len(rows), em.max_batch)]

    async def one(part: list[Any], part_timings: Timings) -> np.ndarray:
        def decode(version: ModelVersion) -> InferRequest:
            return _request(em, version, part)

        try:
            answer = await dataplane.infer(mv.name, mv.version, part_timings, decode)
        except InvalidInput as exc:  # (the runtime's words name no field: the ids are it)
            if em.kind == TEXT or exc.message.startswith("input"):
                raise
            raise InvalidInput(f"input: the model refused these token ids: {exc.message}") from None
        for tensor in answer.outputs:
            if tensor.name == em.output and em.section is not None:
                return _pooled_vectors(em, tensor.data, part, request.dimensions)
            if tensor.name == em.output:
                return np.asarray(tensor.data, dtype=np.float32).reshape(len(part), em.dims)
        raise RTServeError(f"model {mv.name}: no output {em.output!r} in its answer")

    if len(parts) == 1:
        vectors = [await one(parts[0], timings)]
    else:
        vectors = await asyncio.gather(*(one(p, dataclasses.replace(timings)) for p in parts))
    matrix = np.concatenate(vectors) if len(vectors) > 1 else vectors[0]
    data = []
    for i, row in enumerate(matrix):
        value: Any = (
            base64.b64encode(np.ascontiguousarray(row, dtype="<f4").tobytes()).decode()
            if request.base64
            else row
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": request.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _pooled_vectors(
    em: Embedder, states: Any, rows: list[list[int]], dimensions: int | None
) -> np.ndarray:
    """A POOLED model's token states -> the rows' vectors, as its section says."""
    section = em.section
    assert section is not None
    states = np.asarray(states, dtype=np.float32)
    mask = np.zeros(states.shape[:2], dtype=np.int64)
    for i, r in enumerate(rows):
        mask[i, : len(r)] = 1
    vectors = pool(states, mask, section.pooling)
    if dimensions is not None and dimensions < vectors.shape[1]:
        vectors = vectors[:, :dimensions]
    return normalized(vectors) if section.normalize else vectors


def dumps(doc: dict[str, Any]) -> bytes:
    """The answer as JSON (float vectors written straight from numpy)."""
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def model_entries(
    dataplane: DataPlane,
    created: int | None = None,
    allowed: Callable[[str], bool] | None = None,
) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the embedding models (``allowed``: those a key may use)."""
    when = int(time.time()) if created is None else created
    return [
        _entry(name, when, d)
        for name, d in embedding_models(dataplane)
        if allowed is None or allowed(name)
    ]


def model_entry(dataplane: DataPlane, mv: ModelVersion, created: int) -> dict[str, Any] | None:
    """``/v1/models/{id}`` of ``mv`` when it answers embeddings (None: it does not)."""
    try:
        found = None if _generative(mv) else embedder(dataplane, mv)
    except RTServeError:  # (a section that does not fit: not served, as in the list)
        return None
    return None if found is None else _entry(mv.name, created, found.dims)


def _entry(name: str, created: int, dims: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "rtserve",
            "dimensions": dims}  # fmt: skip


async def answer(
    dataplane: DataPlane,
    body: bytes,
    timings: Timings,
    authorize: Callable[[str], None] | None = None,
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """(status, body, headers) of ``POST /v1/embeddings``; errors in OpenAI's shape.
    ``authorize(model)``: raises when the request's key may not use the model."""
    from rtserve.server import openai

    try:
        try:
            request = parse(body)
            if authorize is not None:
                authorize(request.model)
        except Exception as exc:
            dataplane.record_refusal(timings, as_error(exc, "embeddings request"))
            raise
        doc = await embed(dataplane, request, timings)
    except Exception as exc:
        status, text, headers = openai.error_answer(exc)
        return status, text, headers
    return 200, dumps(doc), [(b"content-type", b"application/json")]


def reply(dataplane: DataPlane, guard: Any, request: Any, body: bytes) -> Any:
    """The pending reply to ``POST /v1/embeddings`` (``request``: an ``api.call.Call``;
    ``guard``: the server's key check, or None), the request id on the answer."""
    from rtserve.api.call import Pending
    from rtserve.api.context import timings_of, with_request_id

    timings = timings_of(request.headers, request.received_ns)
    authorize = None
    if guard is not None:

        def authorize(model: str) -> None:
            guard.http_model(request.headers, model)

    async def run() -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        status, text, headers = await answer(dataplane, body, timings, authorize)
        return status, text, with_request_id(headers, timings)

    return Pending(run)
