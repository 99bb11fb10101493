"""Logprobs' `bytes` are the token's own bytes: for byte-level BPE pieces of a multi-byte character and for
SentencePiece byte-fallback tokens (`<0xE2>`) they concatenate to the text's UTF-8 bytes, where decoding each token
alone (the control) gives U+FFFD."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from helpers import make_tiny_tokenizer
from s2d_ray.serve.openai_protocol import ChoiceView, ResponseIds
from s2d_ray.core.logprobs import TokenLogprob
from s2d_ray.token_bytes import token_bytes_fn

TEXT = "caf\u00e9 \u20ac5"  # é (2 bytes) and € (3 bytes): not in the tiny vocabularies as whole tokens


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Metaspace, byte fallback), like Llama 2's or Mistral's."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("\u2581caf", "\u2581", "5", "c", "a", "f"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_token_bytes_rebuild_the_text_for_byte_level_and_byte_fallback():
    for tok in (make_tiny_tokenizer(320), byte_fallback_tokenizer()):
        ids = tok.encode(TEXT, add_special_tokens=False)
        of = token_bytes_fn(tok)
        joined = bytes(b for t in ids for b in of(t)).decode("utf-8")
        assert joined.strip() == TEXT, (type(tok), joined)
        alone = "".join(tok.decode([t]) for t in ids)
        assert "\ufffd" in alone or alone.strip() != TEXT  # the control: one token at a time loses the bytes


def test_served_chat_logprobs_carry_the_token_bytes():
    tok = make_tiny_tokenizer(320)
    ids = tok.encode(TEXT)
    view = ChoiceView(ResponseIds(chat=True), 0, lambda t: tok.decode([t]), True, token_bytes=token_bytes_fn(tok))
    content = view._chat_logprobs([TokenLogprob(t, -0.5, ((t, -0.5),)) for t in ids])["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == TEXT
    assert content[0]["top_logprobs"][0]["bytes"] == content[0]["bytes"]
