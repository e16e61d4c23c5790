"""The clients applications use, unchanged, against a live server on 127.0.0.1: the official
``openai`` client (tools, structured output with pydantic, embeddings, the Responses API),
LangChain's ``langchain-openai`` and ``instructor``. Generative checks run on a random-weight
model and on SmolLM2-135M (when its weights are built); the JSON they return must parse and
match its schema (constrained decoding). Embeddings come from the ``text-embedding``
pipeline and must equal the V2 route's vectors."""

from __future__ import annotations

import base64
import json
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")
pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel  # noqa: E402

from tests.conftest import RunningServer, start_server  # noqa: E402
from tests.llm_models import build_llm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "examples" / "llm-repository" / "smollm2" / "1"
EXAMPLES = ROOT / "examples" / "repository"
EMBEDDING_STEPS = ("minilm-tokenizer", "minilm-int8", "text-embedding")
HAVE_SMOLLM2 = (SMOLLM2 / "model.safetensors").is_file()
HAVE_EMBEDDING = (EXAMPLES / "minilm-int8" / "1" / "model.onnx").is_file()


def _constrained() -> bool:
    from rtserve.runtime.llm import params

    return hasattr(params, "Constraint")


needs_constraints = pytest.mark.skipif(
    not _constrained(), reason="this build has no constrained decoding (llm.params.Constraint)"
)
# Short JSON whatever the weights: enums and booleans.
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "celsius": {"type": "boolean"},
    },
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_PARAMS,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SENTENCES = ["A man is eating food.", "A man is eating bread.", "The sky is blue."]


class City(BaseModel):
    name: Literal["Paris", "Oslo", "Lima"]
    capital: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("openai-clients-repo")
    build_llm(root, "tiny", llm={"max_model_len": 1024, "kv_cache_bytes": 16 << 20})
    if HAVE_SMOLLM2:
        (root / "smollm2").mkdir()
        (root / "smollm2" / "1").symlink_to(SMOLLM2)
        section = {"device": "cpu", "dtype": "float32", "max_model_len": 1024,
                   "kv_cache_bytes": 32 << 20, "block_size": 16, "threads": 1}  # fmt: skip
        import yaml

        (root / "smollm2" / "config.yaml").write_text(
            yaml.safe_dump({"backend": "llm", "llm": section})
        )
    if HAVE_EMBEDDING:
        for name in EMBEDDING_STEPS:
            (root / name).mkdir()
            shutil.copy(EXAMPLES / name / "config.yaml", root / name / "config.yaml")
            (root / name / "1").symlink_to(EXAMPLES / name / "1")
    work = tmp_path_factory.mktemp("openai-clients")
    running = start_server(root, work, timeout=300)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Any:
    return openai.OpenAI(base_url=f"http://{server.http}/v1", api_key="none", max_retries=0)


MODELS = ["tiny", pytest.param("smollm2", marks=pytest.mark.skipif(
    not HAVE_SMOLLM2, reason="SmolLM2 weights not built (make llm-example)"))]  # fmt: skip
needs_embedding = pytest.mark.skipif(
    not HAVE_EMBEDDING, reason="the text-embedding example is not built (make examples)"
)


def _arguments(call: Any, schema: dict[str, Any]) -> dict[str, Any]:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return dict(args)


# ---------------------------------------------------------------------- chat + tools
def test_models_lists_generative_and_embedding_models(client: Any) -> None:
    ids = {m.id for m in client.models.list()}
    assert "tiny" in ids
    if HAVE_EMBEDDING:
        assert "text-embedding" in ids and "minilm-tokenizer" not in ids


def test_models_retrieve_answers_generative_and_embedding_models(client: Any) -> None:
    tiny = client.models.retrieve("tiny")
    assert tiny.id == "tiny" and tiny.object == "model" and tiny.max_model_len == 1024
    if HAVE_EMBEDDING:
        embedding = client.models.retrieve("text-embedding")
        assert embedding.id == "text-embedding" and embedding.dimensions == 384
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve("minilm-tokenizer")  # (a pipeline step: V2 only)
        assert "/v2/models/minilm-tokenizer/infer" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["type"] == "not_found_error"


@needs_constraints
@pytest.mark.parametrize("model", MODELS)
def test_tool_choice_required_and_named_return_valid_calls(client: Any, model: str) -> None:
    answer = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=128, temperature=0,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}
    _arguments(call, schema[call.function.name])
    named = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=128,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    calls = named.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls)
    for c in calls:
        _arguments(c, TIME["function"]["parameters"])


@pytest.mark.parametrize("model", MODELS)
def test_tool_choice_auto_answers_text_or_calls(client: Any, model: str) -> None:
    answer = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], max_tokens=24, temperature=0
    )
    message = answer.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        _arguments(call, WEATHER_PARAMS)
    # the call and its result go back into the next turn
    follow = client.chat.completions.create(
        model=model,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'},
            }]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
        ],
        tools=[WEATHER], max_tokens=8,
    )  # fmt: skip
    assert follow.usage.prompt_tokens > answer.usage.prompt_tokens


@needs_constraints
@pytest.mark.parametrize("model", MODELS)
def test_streamed_tool_calls(client: Any, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=128,
        parallel_tool_calls=False, stream=True,
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMS)


@needs_constraints
@pytest.mark.parametrize("model", MODELS)
def test_parse_with_a_pydantic_model(client: Any, model: str) -> None:
    answer = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Name a capital city."}],
        response_format=City, max_tokens=32,
    )  # fmt: skip
    parsed = answer.choices[0].message.parsed
    assert isinstance(parsed, City)


# ---------------------------------------------------------------------- embeddings
def _v2_vectors(server: RunningServer, texts: list[str]) -> np.ndarray:
    body = {
        "inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]
    }
    request = urllib.request.Request(
        f"http://{server.http}/v2/models/text-embedding/infer",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        out = json.loads(r.read())["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


@needs_embedding
def test_embeddings_float_and_base64_equal_the_v2_vectors(
    client: Any, server: RunningServer
) -> None:
    expected = _v2_vectors(server, SENTENCES)
    answer = client.embeddings.create(
        model="text-embedding", input=SENTENCES, encoding_format="float"
    )
    got = np.asarray([d.embedding for d in answer.data], dtype=np.float32)
    assert [d.index for d in answer.data] == [0, 1, 2]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert answer.usage.prompt_tokens > len(SENTENCES) * 3
    # base64 as the client asks for it by default; decoded by hand too. (The same rows as
    # the V2 request: MiniLM INT8 quantizes activations per batch, so a row's vector
    # depends a little on its batch-mates, on either route.)
    one = _v2_vectors(server, SENTENCES[:1])[0]
    default = client.embeddings.create(model="text-embedding", input=SENTENCES[0])
    np.testing.assert_allclose(default.data[0].embedding, one, atol=1e-6)
    raw = client.embeddings.with_raw_response.create(
        model="text-embedding", input=SENTENCES[:1], encoding_format="base64"
    )
    encoded = json.loads(raw.http_response.text)["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(encoded), "<f4"), one)


@needs_embedding
def test_embeddings_refusals_name_the_field(client: Any) -> None:
    for kwargs, param in (
        ({"model": "text-embedding", "input": SENTENCES[0], "dimensions": 8}, "dimensions"),
        ({"model": "text-embedding", "input": []}, "input"),
        ({"model": "tiny", "input": "x"}, "model"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(**kwargs)
        assert info.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")


# ---------------------------------------------------------------------- Responses API
@needs_constraints
@pytest.mark.parametrize("model", MODELS)
def test_responses_with_a_function_tool(client: Any, model: str) -> None:
    tool = {"type": "function", **WEATHER["function"]}
    response = client.responses.create(
        model=model, input="Weather in Oslo?", tools=[tool], tool_choice="required",
        max_output_tokens=128,
    )  # fmt: skip
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    follow = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "cold"},
        ],
        tools=[tool], tool_choice="none", max_output_tokens=8,
    )  # fmt: skip
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > 10


@pytest.mark.parametrize("model", MODELS)
def test_responses_stream_typed_events(client: Any, model: str) -> None:
    kinds = []
    text = []
    with client.responses.stream(
        model=model,
        input="Say hello.",
        instructions="Be brief.",
        max_output_tokens=8,
        temperature=0,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text.append(event.delta)
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert final.output_text == "".join(text)
    # a real model may end its answer (EOS) inside the budget: then it is complete
    if final.status == "incomplete":
        assert final.usage.output_tokens == 8
        assert final.incomplete_details.reason == "max_output_tokens"
    else:
        assert final.status == "completed" and 0 < final.usage.output_tokens < 8


# ---------------------------------------------------------------------- LangChain, instructor
@needs_constraints
@pytest.mark.parametrize("model", MODELS)
def test_langchain_tools_and_structured_output(server: RunningServer, model: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")

    def get_weather(city: Literal["Paris", "Oslo", "Lima"], celsius: bool) -> str:
        """Current weather in a city."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(
        model=model, base_url=f"http://{server.http}/v1", api_key="none", max_tokens=128,
        max_retries=0,
    )  # fmt: skip
    # strict: the schema forbids other keys (a random-weight model would add some forever)
    bound = llm.bind_tools([get_weather], tool_choice="required", strict=True)
    message = bound.invoke("Weather in Lima?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Oslo", "Lima")
    structured = llm.with_structured_output(City).invoke("Name a capital city.")
    assert isinstance(structured, City)


@needs_embedding
def test_langchain_embeddings_equal_the_v2_vectors(server: RunningServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    embeddings = langchain_openai.OpenAIEmbeddings(
        model="text-embedding", base_url=f"http://{server.http}/v1", api_key="none",
        check_embedding_ctx_length=False, max_retries=0,
    )  # fmt: skip
    got = np.asarray(embeddings.embed_documents(SENTENCES), dtype=np.float32)
    np.testing.assert_allclose(got, _v2_vectors(server, SENTENCES), atol=1e-6)
    query = embeddings.embed_query(SENTENCES[2])
    np.testing.assert_allclose(query, _v2_vectors(server, SENTENCES[2:])[0], atol=1e-6)


@needs_constraints
@pytest.mark.parametrize("model", MODELS)
def test_instructor_extracts_a_pydantic_model(client: Any, model: str) -> None:
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client)
    city = patched.chat.completions.create(
        model=model, response_model=City, max_retries=0, max_tokens=128, temperature=0,
        messages=[{"role": "user", "content": "Paris is the capital of France."}],
    )  # fmt: skip
    assert isinstance(city, City)


# ---------------------------------------------------------------------- n, sampling, guided
@needs_constraints
@pytest.mark.parametrize("model", MODELS)
def test_n_choices_sampling_fields_and_guided_outputs(client: Any, model: str) -> None:
    answer = client.chat.completions.create(
        model=model, messages=ASK, n=3, max_tokens=4, seed=1, frequency_penalty=0.5,
        presence_penalty=0.5, logit_bias={"5": -100},
        extra_body={"min_p": 0.05, "min_tokens": 2, "repetition_penalty": 1.1},
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert 6 <= answer.usage.completion_tokens <= 12
    seen: dict[int, str | None] = {}
    for chunk in client.chat.completions.create(
        model=model, messages=ASK, n=2, max_tokens=3, stream=True
    ):
        for choice in chunk.choices:
            seen[choice.index] = choice.finish_reason or seen.get(choice.index)
    assert seen == {0: "length", 1: "length"} or set(seen) == {0, 1}
    choice = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=16, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert choice.choices[0].message.content in ("yes", "no")
    digits = client.completions.create(
        model=model, prompt="Number:", max_tokens=16,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text)
    obj = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=64, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":  # (any object: its length is the model's)
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )  # fmt: skip
    assert info.value.body["param"] == "response_format.json_schema.schema.type"
