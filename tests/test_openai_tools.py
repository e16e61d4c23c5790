"""Tools, structured-output fields and the Responses API read without a server: what a
request asks for, the schema a required call is decoded under, the calls read back from a
model's text (whole and streamed), and the tool prompt rendered into a real tokenizer's
chat template."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from rtserve.errors import InvalidInput
from rtserve.runtime.llm import chat
from rtserve.server import openai as oa
from rtserve.server import responses, structured
from rtserve.server.tools import CallStream, call_schema, parse_calls, parse_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _chat(**fields: Any) -> bytes:
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(doc).encode()


def test_tool_choice_modes() -> None:
    assert parse_tools({}) is None
    auto = parse_tools({"tools": [WEATHER, TIME]})
    assert auto is not None and auto.mode == "auto" and not auto.constrained
    required = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    assert required is not None and required.constrained
    named = parse_tools(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        }
    )
    assert named is not None and named.mode == "named" and named.name == "get_time"
    flat = parse_tools(  # (the Responses API's spelling)
        {
            "tools": [{"type": "function", "name": "get_time"}],
            "tool_choice": {"type": "function", "name": "get_time"},
        }
    )
    assert flat is not None and flat.name == "get_time"
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert none is not None and none.offered is None


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice.function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)  # fmt: skip
def test_bad_tools_are_named(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput, match=f"^{field.replace('[', '.').replace(']', '.')}: "):
        parse_tools(doc)


def test_required_call_schema_accepts_valid_calls_only() -> None:
    choice = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert choice is not None
    schema = call_schema(choice)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "other", "arguments": {}}],
                [{"name": "get_weather", "arguments": {"city": "P", "unit": "k"}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = parse_tools(
        {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    )
    assert single is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, call_schema(single))
    named = parse_tools(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        }
    )
    assert named is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[:1], call_schema(named))


def test_calls_read_from_text() -> None:
    auto = parse_tools({"tools": [WEATHER]})
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_calls(text, auto)
    assert content == "Let me look." and len(calls) == 1
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    # an unclosed last call counts when its JSON is whole; an unknown function does not
    _, calls = parse_calls('<tool_call>{"name": "get_weather", "arguments": {}}', auto)
    assert len(calls) == 1
    assert parse_calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', auto)[1] == []
    assert parse_calls("<tool_call>{broken", auto) == ("<tool_call>{broken", [])
    assert parse_calls("plain", None) == ("plain", [])
    required = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    content, calls = parse_calls(
        '[{"name": "get_weather", "arguments": {"city": "Rome"}}]', required
    )
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    # parallel calls cut at max_tokens: the whole ones are calls, the cut one is dropped
    cut = '[{"name":"get_weather","arguments":{"city":"Rome"}},{"name":"get_weather","argu'
    content, calls = parse_calls(cut, required)
    assert content is None and len(calls) == 1
    assert parse_calls('[{"name":"get_wea', required) == ('[{"name":"get_wea', [])


def test_streamed_text_holds_back_a_call() -> None:
    stream = CallStream(parse_tools({"tools": [WEATHER]}))
    pieces = [
        "Sure",
        " <",
        "tool_",
        'call>{"name": "get_weather", ',
        '"arguments": {"city": "X"}}',
        "</tool_call>",
    ]
    sent = "".join(stream.feed(p) for p in pieces)
    assert sent == "Sure "
    tail, calls = stream.finish()
    assert tail == "" and calls[0]["function"]["name"] == "get_weather"
    # a "<" that is not a tag is sent once it cannot be one
    stream = CallStream(parse_tools({"tools": [WEATHER]}))
    assert stream.feed("a <") == "a " and stream.feed("b") == "<b"
    assert stream.finish() == ("", [])


def test_structured_output_spellings() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert structured.parse({"response_format": {"type": "json_object"}}) == ("json_object", None)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert structured.parse({"response_format": fmt}) == ("json_schema", schema)
    assert structured.parse({"guided_json": json.dumps(schema)}) == ("json_schema", schema)
    assert structured.parse({"guided_regex": "[0-9]+"}) == ("regex", "[0-9]+")
    assert structured.parse({"structured_outputs": {"choice": ["a", "b"]}}) == (
        "choice",
        ["a", "b"],
    )
    assert structured.parse({"response_format": {"type": "text"}}) is None
    with pytest.raises(InvalidInput, match="^guided_json: a schema of"):
        structured.parse({"guided_json": {"enum": ["x" * 100] * 1000}})
    with pytest.raises(InvalidInput, match="^structured_outputs.grammar: "):
        structured.parse({"structured_outputs": {"grammar": "root ::= 'a'"}})


def test_required_tool_call_is_a_constraint() -> None:
    req = oa.parse_request(_chat(tools=[WEATHER], tool_choice="auto"), oa.CHAT)
    assert req.tools is not None and req.constraint is None
    assert getattr(req.messages, "tools", None) == [WEATHER]
    try:
        req = oa.parse_request(_chat(tools=[WEATHER], tool_choice="required"), oa.CHAT)
    except InvalidInput as exc:  # (a build without constrained decoding says so)
        assert str(exc).startswith("response_format: ")
    else:
        assert req.constraint is not None and req.constraint[0] == "json_schema"
    with pytest.raises(InvalidInput, match="^response_format: expected absent with tool_choice"):
        oa.parse_request(
            _chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
            oa.CHAT,
        )
    with pytest.raises(InvalidInput, match="^tools: expected absent in a completions"):
        oa.parse_request(
            json.dumps({"model": "m", "prompt": "x", "tools": [WEATHER]}).encode(), oa.TEXT
        )


def test_default_tool_prompt_in_a_chat_template() -> None:
    from tests.llm_models import build_tokenizer

    tokenizer = build_tokenizer()
    assert not chat.supports_tools(tokenizer)
    conversation = chat.check_conversation(
        [
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )  # fmt: skip
    turns = chat.with_default_tools(conversation, [WEATHER])
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert "<tools>" in turns[0]["content"] and '"get_weather"' in turns[0]["content"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in turns[2]["content"]
    )
    assert turns[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    prompt = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and "<tool_response>" in prompt
    with pytest.raises(
        InvalidInput, match=r"^messages\[0\].tool_calls: expected only in an assistant"
    ):
        chat.check_conversation([{"role": "user", "content": "x", "tool_calls": [{}]}])
    with pytest.raises(InvalidInput, match=r"^messages\[0\].tool_calls\[0\].function.arguments"):
        chat.check_conversation(
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]
        )


def test_responses_input_becomes_a_chat() -> None:
    doc = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "max_output_tokens": 5,
        "store": True,
    }
    req = responses.parse(doc)
    assert req.kind == oa.RESPONSES and req.params.max_tokens == 5
    assert [m["role"] for m in req.messages or []] == ["system", "user", "assistant", "tool"]
    assert req.tools is not None and req.tools.mode == "auto"
    assert responses.parse({"model": "m", "input": "hi"}).messages == [
        {"role": "user", "content": "hi"}
    ]
    for bad, field in (
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": [{"type": "image"}]}, r"input\[0\].type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, r"tools\[0\].type"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ):
        with pytest.raises(InvalidInput, match=f"^{field}: "):
            responses.parse({"model": "m", **bad})
