"""The bytes each token id stands for, which its decoded text cannot always say: byte-level
BPE (GPT-2, SmolLM2, Qwen) splits a character's UTF-8 bytes over tokens, and SentencePiece
falls back to ``<0xHH>`` byte pieces. Logprobs report these bytes (chat ``bytes``: joined,
they rebuild the text) and the text decoded from them leniently (a part of a character
reads U+FFFD)."""

from __future__ import annotations

import re
from typing import Any

BYTE_LEVEL, SENTENCEPIECE, OTHER = "byte-level", "sentencepiece", "other"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def gpt2_bytes_of_chars() -> dict[str, int]:
    """GPT-2's table from the printable characters a byte-level vocabulary is written in
    to the bytes they stand for: printable Latin-1 bytes are themselves, the others
    (controls, space, ...) are shifted to U+0100 and up, in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


_GPT2 = gpt2_bytes_of_chars()


def tokenizer_kind(tokenizer: Any) -> str:
    """How the tokenizer writes bytes in its vocabulary, read from its decoder."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    state = ""
    if decoder is not None:
        try:
            state = str(decoder.__getstate__())
        except Exception:
            state = type(decoder).__name__
    if "ByteLevel" in state:
        return BYTE_LEVEL
    if "ByteFallback" in state or "\u2581" in state or hasattr(tokenizer, "sp_model"):
        return SENTENCEPIECE
    return OTHER


class TokenBytes:
    """Each token id's bytes and lenient text, looked up once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.kind = tokenizer_kind(tokenizer)
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = frozenset(added)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of ``token_id``; text is the bytes decoded with replacement."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", "replace"), raw)
        return hit

    def _bytes(self, token_id: int) -> bytes:
        tok = self._tok
        if token_id in self._special or token_id in self._added:
            return str(tok.decode([token_id])).encode()  # (written as text, not bytes)
        piece = tok.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return str(tok.decode([token_id])).encode()
        if self.kind == BYTE_LEVEL and all(c in _GPT2 for c in piece):
            return bytes(_GPT2[c] for c in piece)
        if self.kind == SENTENCEPIECE:
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace("\u2581", " ").encode()
        return str(tok.decode([token_id])).encode()
