"""A hostile client against one live server (a random-weight LLM, ``digits`` and the
``text-embedding`` pipeline): each bad request gets a 4xx (gRPC INVALID_ARGUMENT /
NOT_FOUND / RESOURCE_EXHAUSTED) whose message names the field, fast, and a good request
answers after it. Regressions of what such a sweep found: a tool schema nested a few dozen
levels that held the event loop (its ``additionalProperties`` pass was exponential),
Responses errors that named the chat field (``messages``, ``max_tokens``) instead of the
one sent, stored conversations and logprobs ignored, embedding token ids out of the
vocabulary taken or refused without naming ``input``, an unload whose body was malformed
done anyway, Triton generate with ``n`` > 1 interleaving the answers in one text, a V2
infer on an LLM refused for its own default max_tokens, and a gRPC stream's scalar
sampling inputs refused by the element budget."""

from __future__ import annotations

import http.client
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.conftest import RunningServer, start_server  # noqa: E402
from tests.llm_models import build_llm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "repository"
EMBEDDING_STEPS = ("minilm-tokenizer", "minilm-int8", "text-embedding")
HAVE_EMBEDDING = (EXAMPLES / "minilm-int8" / "1" / "model.onnx").is_file()
needs_embedding = pytest.mark.skipif(not HAVE_EMBEDDING, reason="example models not built")
ASK = [{"role": "user", "content": "hi"}]
PIXELS = {"name": "pixels", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("hostile-sweep-repo")
    build_llm(root, "tiny", llm={"max_model_len": 1024, "kv_cache_bytes": 8 << 20})
    names = ["digits", *(EMBEDDING_STEPS if HAVE_EMBEDDING else ())]
    for name in names:
        (root / name).mkdir()
        shutil.copy(EXAMPLES / name / "config.yaml", root / name / "config.yaml")
        (root / name / "1").symlink_to(EXAMPLES / name / "1")
    work = tmp_path_factory.mktemp("hostile-sweep")
    control = ("--model-control-mode", "explicit", "--load-model", "*")
    running = start_server(root, work, *control, timeout=300)
    yield running
    running.stop()


def _post(
    server: RunningServer, path: str, body: Any, timeout: float = 30.0
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _refused(server: RunningServer, path: str, body: Any, field: str) -> str:
    """The error message of a refused request (checks the status and the field named)."""
    status, doc = _post(server, path, body)
    assert 400 <= status < 500, (status, doc)
    error = doc["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert message.startswith(field) or f"'{field}'" in message, message
    assert "Traceback" not in message
    if isinstance(error, dict) and error.get("param") is not None:
        assert error["param"].startswith(field.split("[")[0]), error
    return str(message)


def _serves(server: RunningServer) -> None:
    status, doc = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": ASK,
                                                           "max_tokens": 2})  # fmt: skip
    assert status == 200, doc
    status, doc = _post(server, "/v2/models/digits/infer", {"inputs": [PIXELS]})
    assert status == 200, doc


def _nested_properties(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# ---------------------------------------------------------------------- regressions
def test_closing_a_deep_tool_schema_is_linear() -> None:
    from rtserve.server.tools import closed

    started = time.perf_counter()
    out = closed(_nested_properties(60))
    assert time.perf_counter() - started < 1.0
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    # A property named "properties" is a schema, not a map; enum values are not schemas.
    odd = closed({"type": "object", "properties": {"properties": {"enum": [{"properties": {}}]}}})
    assert odd["properties"] == {"properties": {"enum": [{"properties": {}}]}}


def test_a_deeply_nested_tool_schema_is_answered_at_once(server: RunningServer) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested_properties(40)}}
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, "tools": [tool],
            "tool_choice": "required"}  # fmt: skip
    started = time.monotonic()
    status, doc = _post(server, "/v1/chat/completions", body, timeout=30)
    assert time.monotonic() - started < 20
    assert status == 200 or 400 <= status < 500, doc
    status, _ = _post_raw(server, "/v1/responses", {
        "model": "tiny", "input": "hi", "max_output_tokens": 4, "tool_choice": "required",
        "tools": [{"type": "function", "name": "f", "parameters": _nested_properties(40)}],
    })  # fmt: skip
    assert status == 200 or 400 <= status < 500
    _serves(server)


def _post_raw(server: RunningServer, path: str, body: Any) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body).encode())
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_responses_errors_name_the_fields_sent(server: RunningServer) -> None:
    base = {"model": "tiny", "input": "hi", "max_output_tokens": 4}
    for value in (-1, "x", 1 << 30):
        _refused(server, "/v1/responses", {**base, "max_output_tokens": value},
                 "max_output_tokens")  # fmt: skip
    message = _refused(server, "/v1/responses", {**base, "max_output_tokens": 100_000},
                       "max_output_tokens")  # fmt: skip
    assert "max_model_len" in message
    message = _refused(
        server, "/v1/responses", {**base, "input": [{"type": "reasoning", "summary": []}]}, "input"
    )
    assert "messages" not in message
    _refused(server, "/v1/responses", {**base, "input": "x" * 100_000}, "input")
    _serves(server)


UNANSWERABLE = [("conversation", "conv_1"), ("prompt.id", {"id": "p"}), ("top_logprobs", 3),
                ("logprobs", True), ("n", 2)]  # fmt: skip


@pytest.mark.parametrize("field,value", UNANSWERABLE, ids=[f for f, _ in UNANSWERABLE])
def test_responses_refuse_what_they_cannot_answer(
    server: RunningServer, field: str, value: Any
) -> None:
    """Stored state (a conversation, a prompt template), logprobs and more than one answer,
    which these answers never carry, are refused rather than ignored."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, field.split(".")[0]: value}
    _refused(server, "/v1/responses", body, field)


@needs_embedding
def test_embedding_token_ids_outside_the_vocabulary_name_input(server: RunningServer) -> None:
    body = {"model": "text-embedding", "input": [[101, 2023, 99_999_999]]}
    message = _refused(server, "/v1/embeddings", body, "input[0]")
    assert "99999999" in message and "30522" in message
    ok = {"model": "text-embedding", "input": [[101, 2023, 102]]}
    assert _post(server, "/v1/embeddings", ok)[0] == 200
    # A token-id model without a tokenizer: the runtime's refusal names the field.
    _refused(
        server, "/v1/embeddings", {"model": "minilm-int8", "input": [[1, 99_999_999]]}, "input"
    )
    _refused(server, "/v1/embeddings", {"model": "minilm-int8", "input": [[1] * 1000]}, "input")
    assert (
        _post(server, "/v1/embeddings", {"model": "minilm-int8", "input": [[101, 102]]})[0] == 200
    )


def test_a_malformed_unload_body_unloads_nothing(server: RunningServer) -> None:
    unload = "/v2/repository/models/digits/unload"
    for body, field in [
        (b"{", "unload request body"),
        ([], "unload request body"),
        ({"model": "mlp"}, "unload request body"),
        ({"parameters": 5}, "unload request parameters"),
        (
            {"parameters": {"unload_dependents": "yes"}},
            "unload request parameters.unload_dependents",
        ),
    ]:
        _refused(server, unload, body, field)
    _serves(server)


def test_generate_refuses_n_answers_it_cannot_tell_apart(server: RunningServer) -> None:
    import queue

    import tritonclient.grpc as grpcclient

    for path in ("/v2/models/tiny/generate", "/v2/models/tiny/generate_stream"):
        body = {"text_input": "hi", "parameters": {"n": 2, "max_tokens": 2}}
        _refused(server, path, body, "n")
    client = grpcclient.InferenceServerClient(server.grpc)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hi"], dtype=object))
        client.async_stream_infer("tiny", [text], parameters={"n": 2, "max_tokens": 2})
        result, error = answers.get(timeout=30)
    finally:
        client.stop_stream()
    assert result is None and "parameters.n" in str(error)
    _serves(server)


def test_v2_infer_on_an_llm_fits_its_default_answer_to_the_context(server: RunningServer) -> None:
    """A V2 infer request sets no max_tokens: llm.default_max_tokens (256) is cut to what a
    900-token prompt leaves of max_model_len (1024), not refused naming max_tokens."""
    text = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a " * 900]}
    status, doc = _post(server, "/v2/models/tiny/infer", {"inputs": [text]})
    assert status == 200, doc


def test_v2_infer_on_an_llm_refuses_sampling_it_would_ignore(server: RunningServer) -> None:
    """V2 infer answers with the model's default sampling: ``parameters.max_tokens`` there
    is a 400 naming it and the generate route, not silently ignored; other V2 parameters
    (priority) still pass."""
    text = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hello"]}
    for params in ({"max_tokens": 3}, {"priority": 1, "temperature": 0.5}):
        status, doc = _post(
            server, "/v2/models/tiny/infer", {"inputs": [text], "parameters": params}
        )
        assert status == 400, doc
        name = "max_tokens" if "max_tokens" in params else "temperature"
        assert f"parameters.{name}:" in doc["error"] and "/v2/models/tiny/generate" in doc["error"]
    status, doc = _post(
        server, "/v2/models/tiny/infer", {"inputs": [text], "parameters": {"priority": 1}}
    )
    assert status == 200, doc
    _serves(server)


def _stream(server: RunningServer, request: Any) -> list[Any]:
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    answers = []
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for answer in stub.ModelStreamInfer(iter([request]), timeout=30):
            answers.append(answer)
            final = answer.infer_response.parameters["triton_final_response"].bool_param
            if answer.error_message or final:
                break
    return answers


def test_grpc_stream_takes_sampling_parameters_as_scalar_inputs(server: RunningServer) -> None:
    from tritonclient.grpc import service_pb2 as pb

    def request(name: str, datatype: str, raw: bytes) -> Any:
        tensor = pb.ModelInferRequest.InferInputTensor
        return pb.ModelInferRequest(
            model_name="tiny",
            inputs=[
                tensor(name="text_input", datatype="BYTES", shape=[1]),
                tensor(name=name, datatype=datatype, shape=[1]),
            ],  # fmt: skip
            raw_input_contents=[(2).to_bytes(4, "little") + b"hi", raw],
        )

    answers = _stream(server, request("max_tokens", "INT32", (3).to_bytes(4, "little")))
    assert answers and not any(a.error_message for a in answers)
    answers = _stream(server, request("max_tokens", "BYTES", (1).to_bytes(4, "little") + b"x"))
    assert "max_tokens" in answers[-1].error_message
    answers = _stream(server, request("stream", "BOOL", b"\x01"))
    assert answers and not any(a.error_message for a in answers)


# ---------------------------------------------------------------------- the sweep
CHAT = "/v1/chat/completions"
BAD_CHAT = [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 1000}, "n"),
    ({"logprobs": True, "top_logprobs": 100}, "top_logprobs"),
    ({"stop": ["x"] * 100}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"stream": True, "stream_options": "x"}, "stream_options"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "string", "minLength": 5, "maxLength": 2}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "enum": [f"v{i}" for i in range(10_000)]}}}}, "response_format.json_schema.schema"),
]  # fmt: skip


@pytest.mark.parametrize("fields,field", BAD_CHAT, ids=[f for _, f in BAD_CHAT])
def test_chat_fields(server: RunningServer, fields: dict[str, Any], field: str) -> None:
    _refused(server, CHAT, {"model": "tiny", "messages": ASK, "max_tokens": 4, **fields}, field)


def test_completions_and_embeddings_fields(server: RunningServer) -> None:
    text = {"model": "tiny", "max_tokens": 4}
    _refused(server, "/v1/completions", {**text, "prompt": [1, 2, 999_999]}, "prompt[2]")
    _refused(server, "/v1/completions", {**text, "prompt": [5] * 2000}, "prompt")
    _refused(server, "/v1/completions", {**text, "prompt": "x", "echo": "yes"}, "echo")
    _refused(server, "/v1/embeddings", {"model": "digits", "input": "x"}, "model")
    _refused(server, "/v1/embeddings", {"model": "x", "input": "x", "dimensions": 0}, "dimensions")
    _refused(server, "/v1/embeddings", {"model": "x", "input": ["a"] * 3000}, "input")
    assert _post(server, "/v1/chat/completions", {"model": "nope", "messages": ASK})[0] == 404
    _serves(server)


def test_bodies(server: RunningServer) -> None:
    for path in (CHAT, "/v1/embeddings", "/v1/responses", "/v2/models/digits/infer"):
        for body in (b"{", b"[" * 100_000 + b"]" * 100_000, b'{"model": 1e400}', b'{"a":"\xff"}'):
            status, _ = _post(server, path, body)
            assert 400 <= status < 500, (path, body[:20], status)
    _serves(server)


def test_v2_tensors(server: RunningServer) -> None:
    infer = "/v2/models/digits/infer"
    _refused(server, infer, {"inputs": [{**PIXELS, "shape": [-1, 64]}]}, "pixels")
    _refused(server, infer, {"inputs": [{**PIXELS, "shape": [1 << 40, 1 << 40]}]}, "pixels")
    _refused(server, infer, {"inputs": [{**PIXELS, "datatype": "FP128"}]}, "pixels")
    _refused(server, infer, {"inputs": [PIXELS], "outputs": [{"name": "nope"}]}, "outputs[0]")
    classify = {"name": "logits", "parameters": {"classification": -1}}
    _refused(server, infer, {"inputs": [PIXELS], "outputs": [classify]}, "outputs[0]")
    _refused(server, infer, {"inputs": [PIXELS], "parameters": {"timeout": -5}}, "parameters")
    status, doc = _post(server, "/v2/models/digits/versions/abc/infer", {"inputs": [PIXELS]})
    assert status == 404 and "abc" in doc["error"]
    _serves(server)


def test_grpc_model_infer(server: RunningServer) -> None:
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    raw = np.zeros((1, 64), np.float32).tobytes()

    def tensor(shape: list[int], datatype: str = "FP32") -> Any:
        return pb.ModelInferRequest.InferInputTensor(name="pixels", datatype=datatype, shape=shape)

    cases = [
        ("digits", "", [tensor([1, 64])], [raw, raw], grpc.StatusCode.INVALID_ARGUMENT),
        ("digits", "", [tensor([1, 64])], [raw[:100]], grpc.StatusCode.INVALID_ARGUMENT),
        ("digits", "", [tensor([1 << 40, 1 << 40])], [raw], grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("digits", "", [tensor([1, 64], "XX")], [raw], grpc.StatusCode.INVALID_ARGUMENT),
        ("digits", "abc", [tensor([1, 64])], [raw], grpc.StatusCode.NOT_FOUND),
        ("nope", "", [tensor([1, 64])], [raw], grpc.StatusCode.NOT_FOUND),
    ]
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for model, version, inputs, raws, code in cases:
            request = pb.ModelInferRequest(
                model_name=model, model_version=version, inputs=inputs, raw_input_contents=raws
            )
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(request, timeout=10)
            assert info.value.code() == code, info.value.details()
            details = info.value.details() or ""
            assert any(w in details for w in ("pixels", "raw_input_contents", model, version))
        good = pb.ModelInferRequest(model_name="digits", inputs=[tensor([1, 64])],
                                    raw_input_contents=[raw])  # fmt: skip
        assert stub.ModelInfer(good, timeout=10).outputs


# ------------------------------------------------ stop ids, schema keywords, names, index
def test_stop_token_ids_outside_the_vocabulary_are_refused(server: RunningServer) -> None:
    for ids in ([99_999_999], [1, -1]):
        for path, body in (
            (CHAT, {"model": "tiny", "messages": ASK}),
            ("/v1/completions", {"model": "tiny", "prompt": "hi"}),
        ):
            message = _refused(server, path, {**body, "max_tokens": 2, "stop_token_ids": ids},
                               "stop_token_ids")  # fmt: skip
            assert "vocabulary" in message, message
    message = _refused(server, CHAT, {"model": "tiny", "messages": ASK, "max_tokens": 2,
                                      "stop_token_ids": [2, 99_999_999]}, "stop_token_ids")  # fmt: skip
    assert "99999999" in message and "[0, " in message, message  # (the vocabulary's size)
    status, doc = _post(server, CHAT, {"model": "tiny", "messages": ASK, "max_tokens": 2,
                                       "stop_token_ids": [2]})  # fmt: skip
    assert status == 200, doc
    _serves(server)


BAD_KEYWORDS = [
    ({"type": "integer", "minimum": "x"}, "minimum"),
    ({"type": "string", "maxLength": -1}, "maxLength"),
    ({"type": "object", "required": "a"}, "required"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "properties.a.type"),
    ({"anyOf": [{"type": "integer"}, {"type": "array", "minItems": 1.5}]}, "anyOf[1].minItems"),
    ({"type": "number", "multipleOf": 0}, "multipleOf"),
]


@pytest.mark.parametrize("schema,keyword", BAD_KEYWORDS, ids=[k for _, k in BAD_KEYWORDS])
def test_schema_keywords_of_the_wrong_type_are_refused(
    server: RunningServer, schema: dict[str, Any], keyword: str
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, "response_format": fmt}
    message = _refused(server, CHAT, body, "response_format")
    assert f"response_format.json_schema.schema.{keyword}:" in message, message
    parameters = {"type": "object", "properties": {"x": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, "tools": [tool]}
    message = _refused(server, CHAT, body, "tools[0].function.parameters")
    assert f"tools[0].function.parameters.properties.x.{keyword}:" in message, message


def test_checking_schema_keywords_is_linear_and_takes_usual_schemas() -> None:
    from rtserve.errors import InvalidInput
    from rtserve.server.tools import check_schema

    deep = _nested_properties(900)  # (no recursion: deeper than Python's stack would go)
    started = time.perf_counter()
    check_schema(deep, "s")
    assert time.perf_counter() - started < 1.0
    inner = deep
    for _ in range(800):
        inner = inner["properties"]["a"]
    inner["maxItems"] = -3
    with pytest.raises(InvalidInput, match=r"^s\.\.\..*\.maxItems: expected an integer >= 0"):
        check_schema(deep, "s")
    usual = {  # (as pydantic writes them; draft 4's boolean exclusiveMinimum; tuple items)
        "$defs": {"A": {"properties": {"x": {"title": "X", "type": "integer", "default": 1,
                                             "exclusiveMinimum": 0}},
                        "required": ["x"], "title": "A", "type": "object"}},
        "properties": {"a": {"$ref": "#/$defs/A"},
                       "b": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                       "c": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
                       "d": {"type": "array", "items": [{"type": "string"}], "uniqueItems": True},
                       "e": {"enum": [1, "x", None], "description": "free text"}},
        "required": ["a"], "type": ["object"], "additionalProperties": False,
    }  # fmt: skip
    check_schema(usual, "s")


def test_duplicate_tensor_names_are_refused(server: RunningServer) -> None:
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    infer = "/v2/models/digits/infer"
    message = _refused(server, infer, {"inputs": [PIXELS, PIXELS]}, "inputs[1].name")
    assert "'pixels'" in message, message
    binary = {**PIXELS, "data": [0.5] * 64}  # (not the fast path: a parameters entry)
    binary["parameters"] = {"binary_data": False}
    _refused(server, infer, {"inputs": [binary, binary]}, "inputs[1].name")
    twice = [{"name": "label"}, {"name": "logits"}, {"name": "label"}]
    message = _refused(server, infer, {"inputs": [PIXELS], "outputs": twice}, "outputs[2].name")
    assert "'label'" in message, message
    raw = np.zeros((1, 64), np.float32).tobytes()
    tensor = pb.ModelInferRequest.InferInputTensor(name="pixels", datatype="FP32", shape=[1, 64])
    out = pb.ModelInferRequest.InferRequestedOutputTensor
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for inputs, raws, outputs, field in (
            ([tensor, tensor], [raw, raw], [], "inputs[1].name"),
            ([tensor], [raw], [out(name="label"), out(name="label")], "outputs[1].name"),
        ):
            request = pb.ModelInferRequest(model_name="digits", inputs=inputs,
                                           raw_input_contents=raws, outputs=outputs)  # fmt: skip
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = info.value.details() or ""
            assert details.startswith(field) and "more than once" in details, details
        good = pb.ModelInferRequest(model_name="digits", inputs=[tensor], raw_input_contents=[raw],
                                    outputs=[out(name="label"), out(name="logits")])  # fmt: skip
        assert len(stub.ModelInfer(good, timeout=10).outputs) == 2
    _serves(server)


def test_repository_index_ready_must_be_a_boolean(server: RunningServer) -> None:
    index = "/v2/repository/index"
    message = _refused(server, index, {"ready": "x"}, "ready")
    assert "true or false" in message, message
    _refused(server, index, {"ready": 1}, "ready")
    _refused(server, index, [{"ready": True}], "repository index body")
    for body in (b"", b"{}", b"null", {"ready": False}, {"ready": True}):
        status, doc = _post(server, index, body)
        assert status == 200 and any(e["name"] == "digits" for e in doc), (body, doc)
    _serves(server)
