"""The operator's path to a model: hub ids are hub ids (not missing paths) and resolve through the Hugging Face cache,
offline only under HF_HUB_OFFLINE; plain prompts start with BOS where the tokenizer's config asks; a configured chat
template replaces the tokenizer's; the draft's base model can be pointed elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import make_tiny_tokenizer
from s2d_ray.build import draft_base_source
from s2d_ray.errors import ConfigError, ModelLoadError
from s2d_ray.models import DRAFT_CONFIG
from s2d_ray.models.source_names import classify_source
from s2d_ray.models.sources import resolve_model_dir
from s2d_ray.prompts import encode_messages, encode_prompt, override_chat_template


def test_hub_ids_are_hub_ids_and_paths_stay_paths(tmp_path):
    assert classify_source("lmsys/vicuna-7b-v1.5") == ("hub", "lmsys/vicuna-7b-v1.5")
    assert classify_source("meta-llama/Llama-2-70b-chat-hf")[0] == "hub"
    for path in (str(tmp_path / "nope"), "./models/x", "~/models/x"):
        with pytest.raises(ModelLoadError, match="does not exist"):
            classify_source(path)


def test_an_uncached_hub_id_offline_is_one_line_saying_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"not in the local Hugging Face cache.*huggingface-cli download "
                                             r"s2d-test/not-there"):
        resolve_model_dir("s2d-test/not-there")


def test_plain_prompts_get_bos_only_when_the_tokenizer_asks():
    tok = make_tiny_tokenizer()
    plain = encode_prompt(tok, "hello", chat=False)
    assert tok.bos_token_id is not None and plain[0] != tok.bos_token_id  # SmolLM2-like: no BOS asked
    tok.add_bos_token = True  # Llama-2's tokenizer_config.json
    with_bos = encode_prompt(tok, "hello", chat=False)
    assert with_bos == [tok.bos_token_id] + plain
    assert tok.eos_token_id not in with_bos


def test_a_configured_chat_template_replaces_the_tokenizers(tmp_path):
    tok = make_tiny_tokenizer()
    tok.chat_template = None
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}" \
               "<assistant>{% endif %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    override_chat_template(tok, str(path))
    ids = encode_messages(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<user>hi<assistant>"
    override_chat_template(tok, "{{ messages[0]['content'] }}")  # inline Jinja
    assert tok.decode(encode_messages(tok, [{"role": "user", "content": "hi"}])) == "hi"
    with pytest.raises(ConfigError, match="neither a Jinja template nor a readable file"):
        override_chat_template(tok, str(tmp_path / "missing.jinja"))


def test_the_drafts_base_model_can_be_overridden(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / DRAFT_CONFIG).write_text(json.dumps({"base_model": "/somewhere/else/vicuna-7b-v1.5"}))
    assert draft_base_source(str(draft)) == "/somewhere/else/vicuna-7b-v1.5"
    assert draft_base_source(str(draft), "/mnt/models/vicuna-7b-v1.5") == "/mnt/models/vicuna-7b-v1.5"
