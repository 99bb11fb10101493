"""Incremental detokenization (serve/detokenize.py, prepare.TextAssembler): the streamed text equals the whole
decode at every step on SmolLM2's real byte-level tokenizer and the tiny one, for text with multi-byte characters
and for arbitrary id sequences (characters split across tokens, invalid bytes, special tokens); each step decodes a
bounded window, not the whole sequence."""

from __future__ import annotations

import random

import pytest

from helpers import make_tiny_tokenizer
from s2d_ray.serve.detokenize import IncrementalText
from s2d_ray.serve.prepare import ModelInfo, TextAssembler

TEXT = ("Grüße aus Köln! 東京タワーは高い。 Emoji: 🙂👍🏽🇫🇷 — naïve café, Ελληνικά, עברית, العربية; "
        "math ∑∫√ and tabs\tnewlines\n\nend <|im_end|> after")


@pytest.fixture(scope="module", params=["smollm2", "tiny"])
def tok(request):
    if request.param == "tiny":
        return make_tiny_tokenizer(320)
    from s2d_ray.serve.loaders import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct", None, False)


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _sequences(tok) -> list[list[int]]:
    """The text's ids, and random ids over the whole vocabulary (partial UTF-8 bytes, specials included)."""
    rng = random.Random(0)
    ids = tok.encode(TEXT, add_special_tokens=False)
    out = [ids, list(reversed(ids))]
    out += [[rng.randrange(len(tok)) for _ in range(300)] for _ in range(4)]
    return out


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    """The ids in rounds of 1-5 tokens, as speculative rounds commit them."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[i:i + n])
        i += n
    return out


def test_incremental_text_equals_the_whole_decode_at_every_step(tok):
    decode, rng = _decode(tok), random.Random(1)
    for ids in _sequences(tok):
        stream = IncrementalText(decode)
        for chunk in _chunks(ids, rng):
            before = stream.text
            delta = stream.extend(chunk)
            assert stream.text == before + delta
            full = decode(stream.ids)
            if full.endswith("\ufffd"):  # a character still missing bytes: only complete text so far
                assert full.startswith(stream.text)
            else:
                assert stream.text == full, (stream.ids, stream.text, full)


def test_the_comparison_can_fail():
    """Negative control: token by token decoding (no window) differs from the whole decode on this text."""
    tok = make_tiny_tokenizer(320)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert "".join(tok.decode([i]) for i in ids) != tok.decode(ids)


def test_each_step_decodes_a_bounded_window():
    tok = make_tiny_tokenizer(320)
    ids = tok.encode(TEXT * 20, add_special_tokens=False)
    decoded = {True: 0, False: 0}
    for whole in (False, True):
        def counting(part, whole=whole):
            decoded[whole] += len(part)
            return tok.decode(part, skip_special_tokens=True)

        stream = IncrementalText(counting, whole=whole)
        for t in ids:
            stream.extend([t])
        assert stream.text == tok.decode(ids, skip_special_tokens=True)
    assert decoded[False] < 12 * len(ids)  # a few tokens per step
    assert decoded[True] > len(ids) ** 2 / 3  # the whole decode per step (the control)


@pytest.mark.parametrize("stop", [(), ("ö",), ("東京", "🙂👍"), ("never-there",)])
def test_streamed_deltas_equal_the_final_text(tok, stop):
    info = ModelInfo("m", tok, 4096, ())
    rng = random.Random(2)
    for ids in _sequences(tok)[:3]:
        # The engine ends a sequence at the fewest tokens whose text holds a stop string.
        ends = [n for n in range(1, len(ids) + 1) if any(s in tok.decode(ids[:n], skip_special_tokens=True)
                                                         for s in stop)]
        ids = ids[:ends[0]] if ends else ids
        assembler = TextAssembler(info, stop)
        chunks = _chunks(ids, rng)  # the last one is the finishing round's: where a stop string ends
        deltas = [assembler.push(c) for c in chunks[:-1]]
        deltas.append(assembler.finish(chunks[-1]))
        final = TextAssembler(info, stop, ids).final_text()
        assert "".join(deltas) == final
        assert not any(s in "".join(deltas[:-1]) for s in stop)  # no stop string sent before the cut
