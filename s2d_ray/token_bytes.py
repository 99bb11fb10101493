"""The bytes a token stands for, for logprobs' `bytes` (OpenAI's field: a token's UTF-8 bytes, which may be part of
a character). Decoding one token alone is wrong for byte-fallback tokens (`<0xE2>` decodes to U+FFFD or nothing),
and for byte-level BPE pieces of a multi-byte character, so the bytes come from the vocabulary entry itself:
a byte-level BPE piece through GPT-2's byte <-> character table, a SentencePiece byte token `<0xNN>` as its byte, a
SentencePiece piece with its `▁` as a space, a special token as its text."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Callable

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"  # SentencePiece's word-boundary mark


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as, inverted."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def _byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes_fn(tokenizer) -> Callable[[int], list[int]]:
    """A function from a token id to its bytes (as a list of ints, the wire form)."""
    byte_level = _byte_level(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    table = _byte_level_table() if byte_level else {}

    def of(token: int) -> list[int]:
        piece = tokenizer.convert_ids_to_tokens(int(token))
        if piece is None:
            return []
        if token in special:
            return list(piece.encode("utf-8"))
        if byte_level and all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return [int(match.group(1), 16)]
        if _SPACE in piece:
            return list(piece.replace(_SPACE, " ").encode("utf-8"))
        return list(tokenizer.decode([int(token)]).encode("utf-8"))

    return of
