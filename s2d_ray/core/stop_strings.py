"""Stop strings found in a growing completion by looking only at the text a new stop string can end in.

The rule (vLLM's, with min_tokens): a sequence stops at the fewest generated tokens whose decoded text holds a stop
string ending after the first `min_tokens` tokens' text. Decoding the whole completion every round to apply it costs
O(n^2) over a long completion; `StopScan` decodes only each round's new tokens and searches only their text plus the
previous (longest stop - 1) characters, since every earlier position was searched in an earlier round.

The new text comes from the prefix/read offsets that incremental detokenizers use (vLLM's, and the router's stream
text): the text of ids[prefix:] minus the text of ids[prefix:read], where `read` is the last token boundary at which
the text was complete (no trailing U+FFFD), so the bytes of one character (byte-level pieces, byte-fallback tokens:
up to 4 tokens) are always decoded together, and a decoder's leading-space rule applies alike to both texts. The text
of a character still missing bytes (U+FFFD) is searched as the whole decode shows it. A decoder that rewrites text
across token edges (`clean_up_tokenization_spaces`) makes the window's text differ from the whole text's: `whole`
decodes the whole completion as before. A byte-fallback decoder shows a run of byte tokens as U+FFFD, the characters
it already completed included, while the run's last character misses bytes: in such a round the window's text is no
extension of the earlier text, and that round is searched in the whole decode.
"""

from __future__ import annotations

from typing import Callable, Collection

REPLACEMENT = "\ufffd"  # what decode gives for an incomplete UTF-8 sequence at the end


def stop_string_at(text: str, stops: Collection[str], base: int = 0) -> int:
    """Where the first stop string in `text` that ends after `base` characters starts, or -1 (vLLM's min_tokens
    rule: a stop string inside the first min_tokens tokens' text does not count)."""
    hits = [i for s in stops if (i := text.find(s, max(base - len(s) + 1, 0))) >= 0]
    return min(hits, default=-1)


def whole_text_cut(decode: Callable[[list[int]], str], ids: list[int], stops: Collection[str],
                   min_tokens: int = 0) -> int | None:
    """The rule on whole decodes: the fewest of `ids` whose text has a stop string ending after the first
    `min_tokens` tokens' text, or None (O(n) decodes of O(n) tokens when one is found; the reference `StopScan`
    equals)."""
    if len(ids) <= min_tokens:
        return None
    base = len(decode(ids[:min_tokens])) if min_tokens else 0
    if stop_string_at(decode(ids), stops, base) < 0:
        return None
    for n in range(min_tokens + 1, len(ids) + 1):
        if stop_string_at(decode(ids[:n]), stops, base) >= 0:
            return n
    return None


class StopScan:
    """One sequence's stop-string search, a round's new tokens at a time (`extend`)."""

    def __init__(self, stops: Collection[str], decode: Callable[[list[int]], str], min_tokens: int = 0,
                 whole: bool = False) -> None:
        self.stops, self.decode, self.min_tokens, self.whole = tuple(stops), decode, min_tokens, whole
        self.keep = max((len(s) for s in self.stops), default=1) - 1  # characters a stop can reach back
        self.ids: list[int] = []
        self._prefix = self._read = 0  # token offsets: `read` ends the complete text
        self._stable = 0  # characters of complete text (that of ids[:read]); later text only extends it
        self._tail = ""  # the complete text from character `_stable - len(_tail)` on
        self._clean = 0  # no stop string ends after `base` and at or before this character
        self._base: int | None = 0 if min_tokens == 0 else None  # characters of the first min_tokens tokens' text

    def extend(self, tokens: list[int]) -> int | None:
        """Append a round's tokens; the fewest tokens (of all so far) whose text holds a stop string by the rule, or
        None. After a hit the scan is spent (the sequence ends there)."""
        if self.whole:
            self.ids.extend(tokens)
            return whole_text_cut(self.decode, self.ids, self.stops, self.min_tokens)
        saved = self._state()
        window = self._advance(tokens)
        if len(self.ids) <= self.min_tokens or not self._holds(*window):
            self._settle()
            return None
        # A stop string ends in the text after the complete text: find the first token it ends at, from the last
        # token boundary where the text was complete (a decoder may show a character at one token and hide it
        # behind U+FFFD at the next, while more bytes follow: the stop counts where it first showed).
        pending = self.ids[saved[2] :]
        self._restore(saved)
        for tok in pending:
            window = self._advance([tok])
            if len(self.ids) > self.min_tokens and self._holds(*window):
                return len(self.ids)
        self._settle()  # the decoder's text was not incremental after all (see the module's note): no stop
        return None

    def _advance(self, tokens: list[int]) -> tuple[str, int]:
        """Append tokens and move the offsets past complete text; returns (text, where it starts in the whole text):
        the complete text from `_clean - keep` on, then the text of a character still missing bytes."""
        floor = self.min_tokens - len(self.ids)
        if 0 < floor <= len(tokens):  # the round reaches the first min_tokens tokens: their text's length
            self.ids.extend(tokens[:floor])
            pending = self._pending()
            self._base = self._stable + len(pending) if pending is not None else len(self.decode(self.ids))
            tokens = tokens[floor:]
        self.ids.extend(tokens)
        pending = self._pending()
        if pending is None:  # the window's text did not extend the earlier text: search the whole decode
            return self.decode(self.ids), 0
        return self._tail + pending, self._stable - len(self._tail)

    def _pending(self) -> str | None:
        """Complete the text up to the newest token boundary where it is complete; return the text after it (what
        the whole decode shows of an unfinished character), or None where the window's text is not an extension."""
        if len(self.ids) == self._read:
            return ""
        before = self.decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        after = self.decode(self.ids[self._prefix :])
        if not after.startswith(before):
            return None
        delta = after[len(before) :]
        if delta.endswith(REPLACEMENT) or not delta:
            return delta
        self._prefix, self._read = self._read, len(self.ids)
        self._stable += len(delta)
        self._tail += delta
        return ""

    def _holds(self, text: str, offset: int) -> bool:
        """Whether a stop string in `text` (which starts at character `offset` of the whole text) ends after both
        `base` and the part already searched."""
        lo = max(self._base or 0, self._clean)
        return any(text.find(s, max(lo - len(s) + 1 - offset, 0)) >= 0 for s in self.stops)

    def _settle(self) -> None:
        """No stop string in the text so far: the complete text is searched; keep only what a stop can reach back."""
        self._clean = self._stable
        self._tail = self._tail[max(len(self._tail) - self.keep, 0) :] if self.keep else ""

    def _state(self) -> tuple:
        return len(self.ids), self._prefix, self._read, self._stable, self._tail, self._base  # [2]: read

    def _restore(self, state: tuple) -> None:
        """Back to the state `_state` saved, less the tokens after its complete text (they are sent again)."""
        _, self._prefix, self._read, self._stable, self._tail, self._base = state
        del self.ids[self._read :]
