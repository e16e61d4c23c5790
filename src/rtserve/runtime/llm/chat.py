"""Chat prompts in which a message's text cannot speak for the template.

A chat template writes its turns with special tokens (``<|im_start|>``, ``<|eot_id|>``);
a tokenizer reading the rendered prompt whole would take the same strings typed inside a
message as those tokens, so that a user could close their turn and open a system one. As
vLLM and TGI now do, rtserve reads the text of messages without special tokens: only the
template's own are.

A conversation without any special token's text in its messages is rendered and tokenized
exactly as before (the same ids). One with such text has each occurrence replaced by a
marker (private-use characters that no message holds) before the template renders it; the
rendered prompt is then cut at the template's special tokens, each read as its id, and the
text between them, the markers given back their strings, is tokenized as plain text
(``split_special_tokens``) — as the tokenizer itself cuts a prompt at its special tokens.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from rtserve.errors import InvalidInput

# (tokenizer, the pattern of its special tokens' text), by the tokenizer's id
_PATTERNS: dict[int, tuple[Any, re.Pattern[str] | None]] = {}
_LOCK = threading.Lock()
_PRIVATE = range(0xE000, 0xF900)  # Unicode's private use area (BMP)


def special_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A pattern of the text of every special token of ``tokenizer`` (longest first); None
    if it has none."""
    key = id(tokenizer)
    cached = _PATTERNS.get(key)
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    texts = {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts.update(t.content for t in decoder.values() if getattr(t, "special", False))
    texts.discard("")
    pattern = (
        re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))
        if texts
        else None
    )
    with _LOCK:
        _PATTERNS[key] = (tokenizer, pattern)
    return pattern


@dataclass(slots=True)
class Hidden:
    """A conversation with the special tokens' text in its messages replaced by markers:
    ``typed[i]`` is the text ``open + str(i) + close`` stands for."""

    conversation: list[dict[str, str]]
    typed: list[str] = field(default_factory=list)
    open: str = ""
    close: str = ""

    def encode(self, tokenizer: Any, prompt: str) -> list[int]:
        """The token ids of ``prompt`` (the template rendered over ``conversation``): its
        special tokens those of the template alone, every marker read as plain text."""
        pattern = special_pattern(tokenizer)
        assert pattern is not None and self.typed
        marker = re.compile(re.escape(self.open) + r"(\d+)" + re.escape(self.close))
        typed = self.typed

        def plain(text: str) -> list[int]:
            text = marker.sub(lambda m: typed[int(m.group(1))], text)
            if not text:
                return []
            ids: list[int] = tokenizer.encode(
                text, add_special_tokens=False, split_special_tokens=True
            )
            return ids

        ids: list[int] = []
        start = 0
        for found in pattern.finditer(prompt):  # (the template's: the client's are hidden)
            ids.extend(plain(prompt[start : found.start()]))
            ids.append(tokenizer.convert_tokens_to_ids(found.group(0)))
            start = found.end()
        ids.extend(plain(prompt[start:]))
        return ids


def hide_special_text(tokenizer: Any, conversation: list[dict[str, str]]) -> Hidden:
    """``conversation`` with the text of special tokens in its messages' content replaced by
    markers (``Hidden.typed`` empty, the conversation unchanged, when there is none)."""
    pattern = special_pattern(tokenizer)
    if pattern is None or not any(pattern.search(m["content"]) for m in conversation):
        return Hidden(conversation)
    held = set("".join(m["content"] for m in conversation))
    free = (chr(c) for c in _PRIVATE if chr(c) not in held)
    hidden = Hidden([], [], next(free), next(free))
    typed = hidden.typed

    def mark(found: re.Match[str]) -> str:
        typed.append(found.group(0))
        return f"{hidden.open}{len(typed) - 1}{hidden.close}"

    hidden.conversation = [{**m, "content": pattern.sub(mark, m["content"])} for m in conversation]
    return hidden


def encode_plain(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int] | None:
    """The ids of ``text`` read with no special token, when it holds a special token's text
    (None when it holds none: the caller tokenizes it as usual)."""
    pattern = special_pattern(tokenizer)
    if pattern is None or pattern.search(text) is None:
        return None
    ids: list[int] = tokenizer.encode(
        text, add_special_tokens=add_special_tokens, split_special_tokens=True
    )
    return ids


# ---------------------------------------------------------------------- tools
# The default tool prompt (Hermes' format), for chat templates that do not render tools
# themselves: the functions are listed in the system message, the model answers a call as
# ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, an earlier call goes back in
# the assistant's turn the same way and a tool's result as a user turn in
# ``<tool_response>``. Documented in docs/generative-api.md.
TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions "
    "you can call, as JSON schemas, are within <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object of its name and arguments within "
    "<tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class Messages(list[Any]):
    """A request's chat messages with the tools offered to the model (``tools``: OpenAI's
    ``[{"type": "function", "function": {...}}]``, checked by the API; None: none)."""

    tools: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, messages: Any, tools: list[dict[str, Any]] | None) -> Any:
        if not isinstance(messages, list):
            return messages  # (refused, naming the field, when checked)
        out = cls(messages)
        out.tools = tools
        return out


def supports_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders ``tools`` itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tool_call_text(call: dict[str, Any]) -> str:
    """One call of an assistant message (OpenAI's ``tool_calls[i]``) in Hermes' form."""
    function = call.get("function") or {}
    arguments = function.get("arguments", {})  # (a mapping: check_conversation)
    return (
        "<tool_call>\n"
        + _dumps({"name": function.get("name"), "arguments": arguments})
        + ("\n</tool_call>")
    )


def with_default_tools(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, str]]:
    """``conversation`` in plain ``{role, content}`` turns for a template without tools:
    the tools in the system message, calls and results as text (``TOOLS_PREAMBLE``)."""
    out: list[dict[str, str]] = []
    if tools:
        listed = "\n".join(_dumps(t.get("function", t)) for t in tools)
        preamble = TOOLS_PREAMBLE.format(tools=listed)
        if conversation and conversation[0]["role"] == "system":
            first = conversation[0]["content"]
            out.append(
                {"role": "system", "content": f"{first}\n\n{preamble}" if first else preamble}
            )
            conversation = conversation[1:]
        else:
            out.append({"role": "system", "content": preamble})
    for m in conversation:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(tool_call_text(c) for c in m["tool_calls"])
            out.append(
                {"role": "assistant", "content": f"{content}\n{calls}" if content else calls}
            )
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    return out


MAX_MESSAGES = 1024
MAX_PARTS = 1024  # text parts in one message's content
ROLES = ("system", "user", "assistant", "tool", "developer")


def check_conversation(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages as a chat template takes them (``{role, content}``, with an
    assistant's ``tool_calls`` and a tool result's ``tool_call_id`` kept); errors name the
    field."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("messages: expected a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise InvalidInput(f"messages: expected at most {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidInput(f"{where}: expected an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidInput(
                f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}"[:200]
            )
        if m.get("function_call"):
            raise InvalidInput(f"{where}.function_call: not supported (send tool_calls)")
        calls = m.get("tool_calls")
        content = m.get("content")
        if isinstance(content, list):
            if len(content) > MAX_PARTS:
                raise InvalidInput(f"{where}.content: expected at most {MAX_PARTS} parts")
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") not in ("text", "input_text", "output_text")
                    or not isinstance(part.get("text"), str)
                ):
                    raise InvalidInput(
                        f"{where}.content[{j}]: expected a text part {{type: text, text: ...}}"
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and (calls or role == "assistant"):
            content = ""
        if not isinstance(content, str):
            raise InvalidInput(f"{where}.content: expected a string or a list of text parts")
        turn: dict[str, Any] = {"role": "system" if role == "developer" else role}
        turn["content"] = content
        if calls:
            turn["tool_calls"] = _checked_calls(calls, where, role)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise InvalidInput(f"{where}.tool_call_id: expected a string")
            turn["tool_call_id"] = call_id or ""
        out.append(turn)
    return out


def _checked_calls(calls: Any, where: str, role: Any) -> list[dict[str, Any]]:
    if role != "assistant":
        raise InvalidInput(f"{where}.tool_calls: expected only in an assistant message")
    if not isinstance(calls, list) or len(calls) > MAX_PARTS:
        raise InvalidInput(f"{where}.tool_calls: expected a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", "{}"), str | dict)
        ):
            raise InvalidInput(
                f"{where}.tool_calls[{j}]: expected {{id, type: function, function: "
                "{name, arguments}}}"
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):  # templates (Qwen, Llama 3) iterate a mapping
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise InvalidInput(
                    f"{where}.tool_calls[{j}].function.arguments: expected a JSON object"
                ) from None
        out.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def encode_messages(llm: Any, messages: Any) -> list[int]:
    """The token ids of a chat for ``llm`` (an ``LlmEngine``): messages checked, the tools
    of a ``Messages`` rendered by the chat template when it renders tools (else the
    default tool prompt, ``with_default_tools``), special tokens' text typed in messages
    read as plain text."""
    tools = getattr(messages, "tools", None)
    tokenizer = llm.tokenizer
    conversation = check_conversation(messages)
    native = supports_tools(tokenizer)
    if not native and (
        tools or any(m["role"] == "tool" or "tool_calls" in m for m in conversation)
    ):
        conversation = with_default_tools(conversation, tools)
        tools = None
    llm.check_chars(sum(len(m["content"]) for m in conversation), "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation) + "assistant:"
        plain = encode_plain(tokenizer, text, True)  # (all of it typed)
        return plain if plain is not None else llm._encode(text, True, "messages")
    hidden = hide_special_text(tokenizer, conversation)
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    try:
        prompt: Any = tokenizer.apply_chat_template(
            hidden.conversation, add_generation_prompt=True, tokenize=False, **extra
        )
    except Exception as exc:
        raise InvalidInput(f"messages: the chat template refused them: {exc}") from exc
    if hidden.typed:
        llm.check_chars(len(prompt), "messages")
        return hidden.encode(tokenizer, prompt)
    ids: list[int] = llm._encode(prompt, False, "messages")
    return ids
