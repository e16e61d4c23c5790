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

import re
import threading
from dataclasses import dataclass, field
from typing import Any

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
