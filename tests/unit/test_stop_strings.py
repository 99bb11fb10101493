"""Stop strings searched on each round's new text (core/stop_strings.StopScan) stop exactly where the whole-text rule
does: random token streams in random rounds, random stop strings taken from the text (multi-byte characters, stops
spanning rounds, min_tokens floors) on SmolLM2's byte-level tokenizer, the tiny one and a SentencePiece-style
tokenizer with byte-fallback tokens (a character in up to 4 tokens, a leading space the decoder strips); each round
decodes a bounded window; a window one character too short misses stops (the control)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from helpers import make_tiny_tokenizer
from s2d_ray.core.stop_strings import REPLACEMENT, StopScan, whole_text_cut

TEXT = ("Grüße aus Köln! 東京タワーは高い。 Emoji: 🙂👍🏽🇫🇷 — naïve café, Ελληνικά, עברית, العربية; "
        "math ∑∫√ and tabs\tnewlines\n\nend <|im_end|> after")


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama's scheme: '▁' for spaces, ASCII pieces, every other character as its UTF-8 bytes (<0xNN> tokens), and a
    decoder that strips the text's first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁"] + [chr(c) for c in range(33, 127)] + ["▁the", "▁a", "er", "in", "▁ma", "th"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "a"), ("e", "r"), ("i", "n"), ("▁", "m"), ("▁m", "a"),
              ("t", "h")]
    vocab.update({"▁t": len(vocab), "▁th": len(vocab) + 1, "▁m": len(vocab) + 2})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["smollm2", "tiny", "byte-fallback"])
def tok(request):
    if request.param == "tiny":
        return make_tiny_tokenizer(320)
    if request.param == "byte-fallback":
        return byte_fallback_tokenizer()
    from s2d_ray.serve.loaders import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct", None, False)


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _streams(tok, rng: random.Random) -> list[list[int]]:
    """The text's ids, shuffled pieces of them, and random ids over the whole vocabulary (partial UTF-8 bytes,
    byte tokens, specials)."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    out = [ids, ids[::-1]]
    out += [rng.sample(ids, len(ids)) for _ in range(3)]
    out += [[rng.randrange(len(tok)) for _ in range(120)] for _ in range(6)]
    return out


def _rounds(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        out.append(ids[i : i + n])
        i += n
    return out


def _stops(text: str, rng: random.Random) -> tuple[str, ...]:
    """1-4 stop strings: pieces of the text (so they are found, often across rounds), sometimes one never there."""
    stops = []
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.15 or len(text) < 2:
            stops.append("never-there-" + str(rng.random()))
            continue
        a = rng.randrange(len(text) - 1)
        piece = text[a : a + rng.randint(1, 8)]
        if REPLACEMENT not in piece and piece:  # U+FFFD stands for bytes, not text (see the module's note)
            stops.append(piece)
    return tuple(stops) or ("x",)


def _compare(decode, ids, rounds, stops, min_tokens, shorten: int = 0) -> tuple[int | None, int | None]:
    """(the scan's cut, the whole rule's cut), round by round as the engine applies them, until one stops."""
    scan = StopScan(stops, decode, min_tokens)
    scan.keep -= shorten
    seen: list[int] = []
    for chunk in rounds:
        seen += chunk
        got, want = scan.extend(chunk), whole_text_cut(decode, seen, stops, min_tokens)
        if got is not None or want is not None:
            return got, want
    return None, None


def test_the_scan_stops_where_the_whole_text_rule_does(tok):
    decode, rng = _decode(tok), random.Random(0)
    hits = 0
    for ids in _streams(tok, rng):
        text = decode(ids)
        for _ in range(12):
            stops, min_tokens = _stops(text, rng), rng.choice([0, 0, 1, 3, 7])
            got, want = _compare(decode, ids, _rounds(ids, rng), stops, min_tokens)
            assert got == want, (ids, stops, min_tokens)
            hits += want is not None
    assert hits > 30  # stops were really found (most streams hold them)


def test_a_window_one_character_short_misses_stops(tok):
    """Negative control: searching one character less of the earlier text than the longest stop needs."""
    decode, rng = _decode(tok), random.Random(0)
    missed = 0
    for ids in _streams(tok, rng):
        text = decode(ids)
        for _ in range(12):
            stops, min_tokens = _stops(text, rng), rng.choice([0, 0, 1, 3, 7])
            got, want = _compare(decode, ids, _rounds(ids, rng), stops, min_tokens, shorten=1)
            missed += got != want
    assert missed > 0


def test_multi_byte_stops_spanning_rounds_token_by_token():
    tok = byte_fallback_tokenizer()
    decode = _decode(tok)
    ids = tok.encode("naïve 東京タワー🙂 end", add_special_tokens=False)
    assert sum(1 for i in ids if 3 <= i < 259) >= 12  # byte tokens: characters of 3-4 tokens each
    for stop in ("東京", "ー🙂", "🙂", "e 東", "ïve"):
        want = whole_text_cut(decode, ids, (stop,))
        scan = StopScan((stop,), decode)
        got = next((c for t in ids if (c := scan.extend([t])) is not None), None)
        assert got == want is not None
        assert stop in decode(ids[:got]) and stop not in decode(ids[: got - 1])


def test_min_tokens_counts_only_stops_ending_after_its_text():
    tok = make_tiny_tokenizer(320)
    decode = _decode(tok)
    ids = tok.encode("stop here, then stop again", add_special_tokens=False)
    first = StopScan(("stop",), decode).extend(ids)
    later = StopScan(("stop",), decode, min_tokens=first).extend(ids)
    assert first == whole_text_cut(decode, ids, ("stop",))
    assert later == whole_text_cut(decode, ids, ("stop",), first) and later > first
    assert decode(ids[:later]).count("stop") == 2  # the first "stop" lies inside the first min_tokens' text


def test_each_round_decodes_a_bounded_window():
    tok = make_tiny_tokenizer(320)
    ids = tok.encode(TEXT * 10, add_special_tokens=False)
    decoded = {True: 0, False: 0}
    for whole in (False, True):
        def counting(part, whole=whole):
            decoded[whole] += len(part)
            return tok.decode(part, skip_special_tokens=True)

        scan = StopScan(("never-there",), counting, whole=whole)
        for t in ids:
            assert scan.extend([t]) is None
    assert decoded[False] < 12 * len(ids)  # a few tokens per round
    assert decoded[True] > len(ids) ** 2 / 3  # the whole completion per round (the control)


def test_the_engine_stops_alike_searching_round_tails_or_whole_decodes():
    """Speculative rounds (1-5 tokens each) over a tiny target whose ids are byte tokens of the tiny tokenizer
    (characters spanning rounds): the same tokens and finish reasons either way, stops found at all."""
    from core_fixtures import noisy_draft, random_prompts, tiny_target
    from s2d_ray.core.draft import SortedDrafter
    from s2d_ray.core.engine import GenerationRequest, SpecEngine
    from s2d_ray.core.policy import FixedK
    from s2d_ray.core.target import TargetVerifier

    target, decode, rng = tiny_target(seed=0), _decode(make_tiny_tokenizer(320)), random.Random(3)
    prompts = random_prompts(6, seed=11)
    free = SpecEngine(TargetVerifier(target)).generate([GenerationRequest(f"f{i}", p, 40)
                                                        for i, p in enumerate(prompts)])
    reqs = []
    for i, (p, res) in enumerate(zip(prompts, free)):
        for j in range(4):
            stops = _stops(decode(res.token_ids), rng)
            reqs.append(GenerationRequest(f"s{i}.{j}", p, 40, stop_strings=stops, min_tokens=rng.choice([0, 2, 5])))
    out = {}
    for whole in (False, True):
        engine = SpecEngine(TargetVerifier(target), SortedDrafter(noisy_draft(target)), FixedK(4), detokenize=decode,
                            detokenize_whole=whole)
        out[whole] = [(r.token_ids, r.finish_reason) for r in engine.generate(reqs)]
    assert out[False] == out[True]
    assert sum(reason == "stop" for _, reason in out[False]) > len(reqs) // 2
