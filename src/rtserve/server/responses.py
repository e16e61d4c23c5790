"""OpenAI's Responses API (``POST /v1/responses``), stateless, over the chat machinery.

A request is read into a chat request (``parse``): ``instructions`` become the system
message; ``input`` is text or a list of items (messages, ``function_call`` and
``function_call_output`` items, which go back as an assistant's tool call and a tool
result); ``tools`` (function tools), ``tool_choice``, ``parallel_tool_calls``,
``text.format`` (structured output), ``max_output_tokens``, ``temperature``, ``top_p``.
Nothing is stored: ``store`` true is answered as false, and ``previous_response_id`` (a
stored conversation) is refused. The answer is a ``response`` object whose ``output`` holds
a message and / or ``function_call`` items (``complete``), or its typed server-sent events
(``stream``: ``response.created`` ... ``response.output_text.delta`` ...
``response.completed``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import orjson

from rtserve.errors import InvalidInput
from rtserve.runtime.llm.params import GenerationEvent
from rtserve.server import openai, structured
from rtserve.server.tools import CallStream

# Fields accepted and not used (they do not change the answer).
_IGNORED = ("metadata", "user", "store", "truncation", "service_tier", "safety_identifier",
            "prompt_cache_key", "background", "include", "stream_options")  # fmt: skip
_ROLES = ("user", "system", "developer", "assistant")


def _fail(field: str, expected: str, value: Any) -> InvalidInput:
    return InvalidInput(f"{field}: expected {expected}, got {repr(value)[:60]}")


def parse(doc: dict[str, Any]) -> openai.OpenAIRequest:
    """A Responses request as a chat request (``kind`` RESPONSES; the original fields the
    answer repeats in ``request.extra``)."""
    if doc.get("previous_response_id") is not None:
        raise _fail(
            "previous_response_id",
            "absent (rtserve stores no responses: send the conversation in input)",
            doc["previous_response_id"],
        )
    if doc.get("conversation") is not None:
        raise _fail(
            "conversation",
            "absent (rtserve stores no conversations: send the conversation in input)",
            doc["conversation"],
        )
    if doc.get("prompt") is not None:  # ("prompt.id": a bare "prompt" reads as input's)
        raise _fail(
            "prompt.id",
            "absent (rtserve stores no prompt templates: send instructions and input)",
            doc["prompt"],
        )
    for key in ("top_logprobs", "logprobs"):
        if doc.get(key) not in (None, 0, False):
            raise _fail(
                key,
                "absent (these answers carry no logprobs: ask /v1/chat/completions for them)",
                doc[key],
            )
    if doc.get("background"):
        raise _fail("background", "false or absent", doc["background"])
    if doc.get("reasoning") not in (None, {}):
        raise _fail("reasoning", "absent (the model does not reason apart)", doc["reasoning"])
    chat: dict[str, Any] = {
        k: v for k, v in doc.items() if k not in _IGNORED and k not in _RESPONSES_ONLY
    }
    messages: list[dict[str, Any]] = []
    instructions = doc.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _fail("instructions", "a string", instructions)
        messages.append({"role": "system", "content": instructions})
    messages.extend(_messages(doc.get("input")))
    chat["messages"] = messages
    tools = doc.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _fail("tools", "a list of function tools", tools)
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise _fail(
                    f"tools[{i}].type",
                    '"function" (rtserve runs no hosted tools)',
                    tool.get("type") if isinstance(tool, dict) else tool,
                )
    text = doc.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise _fail("text", "an object such as {format: {type: json_schema, ...}}", text)
        if structured.response_format(text.get("format"), "text.format") is not None:
            chat["response_format"] = _chat_format(text["format"])
    if doc.get("max_output_tokens") is not None:
        chat["max_tokens"] = doc["max_output_tokens"]
    request = openai.parse_document(chat, openai.CHAT)
    request.kind = openai.RESPONSES
    if request.n != 1:
        raise _fail("n", "absent (a response has one answer)", doc.get("n"))
    request.extra = {
        "instructions": instructions,
        "tools": tools or [],
        "tool_choice": doc.get("tool_choice", "auto"),
        "parallel_tool_calls": doc.get("parallel_tool_calls", True),
        "text": text or {"format": {"type": "text"}},
        "max_output_tokens": doc.get("max_output_tokens"),
        "temperature": doc.get("temperature"),
        "top_p": doc.get("top_p"),
        "metadata": doc.get("metadata") or {},
        "user": doc.get("user"),
    }
    return request


_RESPONSES_ONLY = ("input", "instructions", "text", "max_output_tokens", "previous_response_id",
                   "reasoning", "conversation", "prompt")  # fmt: skip


def _chat_format(value: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` in chat's ``response_format`` spelling."""
    if value.get("type") != "json_schema":
        return value
    spec = {k: v for k, v in value.items() if k in ("name", "schema", "strict", "description")}
    return {"type": "json_schema", "json_schema": spec}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") not in ("input_text", "output_text", "text")
                or not isinstance(part.get("text"), str)
            ):
                raise _fail(f"{where}[{j}]", "a text part {type: input_text, text: ...}", part)
            parts.append(part["text"])
        return "".join(parts)
    raise _fail(where, "a string or a list of text parts", content)


def _messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages."""
    if isinstance(value, str):
        if not value:
            raise _fail("input", "a non-empty string or a list of items", value)
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _fail("input", "a non-empty string or a list of items", value)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _fail(where, "an item object (message, function_call, ...)", item)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _fail(f"{where}.role", f"one of {', '.join(_ROLES)}", role)
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise _fail(where, "a function_call with name and arguments (a string)", item)
            call = {
                "id": str(item.get("call_id") or ""),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _text(output, f"{where}.output")
            out.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": output}
            )
        elif kind == "reasoning":
            continue  # (a model's reasoning summary: nothing for this model to read)
        else:
            raise _fail(f"{where}.type", "message, function_call or function_call_output", kind)
    if not out:
        raise _fail("input", "at least one message or function call item", value)
    return out


# ---------------------------------------------------------------------- answers
class _Response:
    """One response's ids and its ``response`` object."""

    def __init__(self, request: openai.OpenAIRequest) -> None:
        self.request = request
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.sequence = 0

    def document(self, status: str, last: GenerationEvent | None = None) -> dict[str, Any]:
        extra = self.request.extra
        doc: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.request.model,
            "output": self.output,
            "store": False,
            "previous_response_id": None,
            "reasoning": None,
            "truncation": "disabled",
            **extra,
            "usage": None,
        }
        if last is not None:
            u = openai.usage(last)
            doc["usage"] = {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": u["prompt_tokens_details"]["cached_tokens"]
                },
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"],
            }
            if last.finish_reason == "length":
                doc["status"] = "incomplete"
                doc["incomplete_details"] = {"reason": "max_output_tokens"}
        return doc

    def event(self, kind: str, **fields: Any) -> bytes:
        doc = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(doc) + b"\n\n"


def _message(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [_part(text)] if status == "completed" else [],
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


async def complete(
    request: openai.OpenAIRequest, events: AsyncGenerator[GenerationEvent, None]
) -> dict[str, Any]:
    """The whole ``response`` object once generation ends."""
    from rtserve.server.tools import parse_calls

    texts: list[str] = []
    last = None
    async with aclosing(events):
        async for event in events:
            last = event
            texts.append(event.text)
    response = _Response(request)
    content, calls = parse_calls("".join(texts), request.tools)
    if content:
        response.output.append(_message(content))
    response.output.extend(_function_call(c) for c in calls)
    return response.document("completed", last)


async def stream(
    request: openai.OpenAIRequest, events: AsyncGenerator[GenerationEvent, None]
) -> AsyncGenerator[bytes, None]:
    """The response's typed events: created, in_progress, the message's text deltas (text
    that may be a tool call held back), the function calls, completed. A failure after
    the stream began is an ``error`` event."""
    response = _Response(request)
    calls = CallStream(request.tools)
    message: dict[str, Any] | None = None
    texts: list[str] = []
    last = None

    def open_message() -> list[bytes]:
        nonlocal message
        message = _message("", "in_progress")
        response.output.append(message)
        index = len(response.output) - 1
        return [
            response.event("response.output_item.added", output_index=index, item=message),
            response.event(
                "response.content_part.added",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                part=_part(""),
            ),
        ]

    async with aclosing(events):
        try:
            yield response.event("response.created", response=response.document("in_progress"))
            yield response.event("response.in_progress", response=response.document("in_progress"))
            async for event in events:
                last = event
                text = calls.feed(event.text)
                found: list[dict[str, Any]] = []
                if event.finished:
                    tail, found = calls.finish()
                    text += tail
                if text:
                    if message is None:
                        for chunk in open_message():
                            yield chunk
                    assert message is not None
                    texts.append(text)
                    yield response.event(
                        "response.output_text.delta",
                        item_id=message["id"],
                        output_index=response.output.index(message),
                        content_index=0,
                        delta=text,
                        logprobs=[],
                    )
                if event.finished:
                    for chunk in _close_message(response, message, "".join(texts)):
                        yield chunk
                    for call in found:
                        for chunk in _call_events(response, call):
                            yield chunk
            # (completed, also when the answer was cut: its status says incomplete, as the
            # clients' stream helpers wait for this event)
            yield response.event(
                "response.completed", response=response.document("completed", last)
            )
        except Exception as exc:
            _, error = openai.error_document(exc, openai.RESPONSES)
            yield response.event(
                "error",
                code=error["error"]["code"],
                message=error["error"]["message"],
                param=error["error"]["param"],
            )


def _close_message(response: _Response, message: dict[str, Any] | None, text: str) -> list[bytes]:
    if message is None:
        return []
    index = response.output.index(message)
    message["status"] = "completed"
    message["content"] = [_part(text)]
    return [
        response.event(
            "response.output_text.done",
            item_id=message["id"],
            output_index=index,
            content_index=0,
            text=text,
            logprobs=[],
        ),
        response.event(
            "response.content_part.done",
            item_id=message["id"],
            output_index=index,
            content_index=0,
            part=_part(text),
        ),
        response.event("response.output_item.done", output_index=index, item=message),
    ]


def _call_events(response: _Response, call: dict[str, Any]) -> list[bytes]:
    item = _function_call(call, "in_progress")
    response.output.append(item)
    index = len(response.output) - 1
    arguments = call["function"]["arguments"]
    out = [
        response.event("response.output_item.added", output_index=index, item=dict(item)),
        response.event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=index,
            delta=arguments,
        ),
        response.event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=arguments,
            name=item["name"],
        ),
    ]
    item["arguments"] = arguments
    item["status"] = "completed"
    out.append(response.event("response.output_item.done", output_index=index, item=item))
    return out
