"""One request schema for both entry points: the HTTP (OpenAI) requests and the handle API's GenerateRequest share
their sampling fields; only the temperature default differs (OpenAI's 1, the handle's greedy 0); temperatures below
the core's greedy threshold decode greedily."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from s2d_ray.core.types import GREEDY_TEMPERATURE
from s2d_ray.serve.openai_protocol import (
    HANDLE_TEMPERATURE, OPENAI_TEMPERATURE, ChatCompletionRequest, CompletionRequest, GenerateRequest, SamplingFields,
)

CHAT = '{"model": "m", "messages": [{"role": "user", "content": "hi"}]%s}'


def test_both_entry_points_share_the_sampling_fields():
    shared = set(SamplingFields.model_fields)
    for model in (CompletionRequest, ChatCompletionRequest, GenerateRequest):
        assert issubclass(model, SamplingFields) and shared <= set(model.model_fields)
        for name in shared - {"temperature"}:
            assert model.model_fields[name].default == SamplingFields.model_fields[name].default, (model, name)


def test_temperature_defaults_are_openais_over_http_and_greedy_through_the_handle():
    assert OPENAI_TEMPERATURE == 1.0 and HANDLE_TEMPERATURE == 0.0
    assert CompletionRequest.model_validate_json('{"model": "m", "prompt": "x"}').temperature == OPENAI_TEMPERATURE
    assert ChatCompletionRequest.model_validate_json(CHAT % "").temperature == OPENAI_TEMPERATURE
    assert GenerateRequest(model="m", prompt="x").temperature == HANDLE_TEMPERATURE
    # Each choice of an HTTP request carries the request's own values into its GenerateRequest.
    (choice,) = CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "stop": "\\n"}').to_generate()
    assert choice.temperature == OPENAI_TEMPERATURE and choice.stop_list == ["\n"]
    with pytest.raises(ValidationError, match="temperature"):  # the same bounds through the handle
        GenerateRequest(model="m", prompt="x", temperature=2.5)


def test_chat_needs_a_token_and_completions_allow_zero_only_with_echo():
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate_json(CHAT % ', "max_tokens": 0', strict=True)
    assert err.value.errors()[0]["loc"] == ("max_tokens",)
    with pytest.raises(ValidationError, match="only with echo"):
        CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "max_tokens": 0}', strict=True)
    ok = CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "max_tokens": 0, "echo": true}')
    assert ok.to_generate()[0].max_tokens == 0


def test_temperatures_below_the_greedy_threshold_decode_greedily():
    from s2d_ray.serve.app_config import Limits
    from s2d_ray.serve.prepare import ModelInfo, to_generation

    class Vocabulary:  # what prepare reads of a tokenizer for token-id prompts
        def __len__(self) -> int:
            return 100

    info = ModelInfo("m", Vocabulary(), 64, (2,))
    limits = Limits()
    for t, greedy in ((0.0, True), (GREEDY_TEMPERATURE / 10, True), (GREEDY_TEMPERATURE, False), (0.7, False)):
        gen = to_generation(info, GenerateRequest(model="m", prompt_token_ids=[5, 6], temperature=t), limits)
        assert gen.params.greedy == greedy and (gen.params.temperature == 0.0) == greedy, t
