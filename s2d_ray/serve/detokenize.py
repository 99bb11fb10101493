"""Incremental detokenization: a stream's text grows by decoding only its newest tokens, not the whole sequence each
round (which costs O(n^2) over a long completion, on the router's event loop).

The scheme is vLLM's prefix/read offsets over the tokenizer's own `decode`: the text of ids[prefix:] minus the
text of ids[prefix:read] is what the tokens after `read` add. The window starts at the previous read offset, a
token boundary where the text was complete (no trailing U+FFFD), so byte-level pieces and byte-fallback bytes of
one character are always decoded together; a leading-space rule of the decoder (SentencePiece's "▁") applies the
same way to both texts, so their difference is exact. Tokenizers that clean up spaces around punctuation after
decoding (`clean_up_tokenization_spaces`) rewrite text across a window's edge: they decode the whole sequence.
The result equals the full decode (`tests/unit/test_detokenize.py` checks it on real and tiny tokenizers).
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"  # what decode gives for an incomplete UTF-8 sequence at the end


class IncrementalText:
    """The decoded text of a growing id sequence; `text` is complete characters only (a character still missing
    bytes waits for its next tokens)."""

    def __init__(self, decode: Callable[[list[int]], str], whole: bool = False) -> None:
        self.decode, self.whole = decode, whole
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def extend(self, tokens: list[int]) -> str:
        """Append tokens; return the text they complete ("" while a character is unfinished)."""
        self.ids.extend(tokens)
        if self.whole:
            full = self.decode(self.ids).rstrip(REPLACEMENT)
            delta = full[len(self.text):] if len(full) > len(self.text) and full.startswith(self.text) else ""
            self.text += delta
            return delta
        if len(self.ids) == self._read:
            return ""
        before = self.decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        after = self.decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


def cleans_up_spaces(tokenizer) -> bool:
    """Whether `decode` rewrites spaces around punctuation by default (then only a whole decode is exact)."""
    return bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
