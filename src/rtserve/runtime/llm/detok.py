"""Incremental detokenization with stop strings.

Text is emitted as tokens arrive, except what cannot be final yet: a partial UTF-8
character (the decoder yields U+FFFD until the rest arrives) and a tail that could be the
start of a stop string. At the end, what is still held is flushed (a partial character as
U+FFFD), unless a stop string ended the text.
"""

from __future__ import annotations

from typing import Any


class Detokenizer:
    __slots__ = (
        "_tok", "_ids", "_prefix", "_read", "text", "emitted", "_stops", "_hold", "stopped",
    )  # fmt: skip

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # decode window start (earlier text is final)
        self._read = 0  # tokens already turned into text
        self.text = ""  # all text so far (up to a stop string, once one is seen)
        self.emitted = 0  # characters of ``text`` handed out
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.stopped = False  # a stop string ended the text

    def add(self, token: int) -> bool:
        """Append a token; True when a stop string ended the text."""
        self._ids.append(token)
        decode = self._tok.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        now = decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return False
        start = len(self.text)
        self.text += now[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        if not self._stops:
            return False
        search_from = max(0, start - self._hold)
        cut = -1
        for s in self._stops:
            i = self.text.find(s, search_from)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut == -1:
            return False
        self.text = self.text[:cut]
        self.stopped = True
        return True

    def delta(self, final: bool) -> str:
        """The text not yet handed out that can be (all of it when ``final``, with a
        partial character held at the end decoded with replacement)."""
        if final and not self.stopped and self._read < len(self._ids):
            decode = self._tok.decode
            before = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
            now = decode(self._ids[self._prefix :], skip_special_tokens=True)
            if len(now) > len(before):
                self.text += now[len(before) :]
            self._prefix = self._read = len(self._ids)
        end = len(self.text) if final else max(self.emitted, len(self.text) - self._hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out


def text_offsets(tokenizer: Any, ids: list[int]) -> list[int]:
    """Where each token's text starts in the text of ``ids``, decoded as a generation's is
    (a token that ends a character split over several starts where that character does)."""
    detok = Detokenizer(tokenizer, ())
    starts = []
    for token in ids:
        starts.append(len(detok.text))
        detok.add(token)
    return starts
