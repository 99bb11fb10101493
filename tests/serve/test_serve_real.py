"""The real SmolLM2-135M-Instruct served on Ray: greedy output over HTTP equals in-process target-only greedy."""

from __future__ import annotations

import pytest

from serve_helpers import Reference, post

pytestmark = [pytest.mark.serve, pytest.mark.real]


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference("smollm2-135m-instruct", "float32")


def test_real_chat_greedy_over_http_equals_in_process(real_app, ref):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 24, "temperature": 0}
    resp = post(f"{real_app.url}/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    expected = ref.greedy(ref.ids(messages=messages), 24)
    assert out["choices"][0]["message"]["content"] == ref.text(expected)
    assert out["usage"]["completion_tokens"] == len(expected)
    spec = out["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0 and spec["num_target_forwards"] >= 1


@pytest.mark.tp
def test_real_tp3_equals_tp1(real_tp_app, ref):
    from s2d_ray.serve.openai_protocol import GenerateRequest

    stats = real_tp_app.handle.stats.remote().result()["targets"]["smollm2-tp3"]["deployment"]
    assert stats["tp_size"] == 3 and len({r["pid"] for r in stats["ranks"]}) == 3
    prompt = "The three primary colors are"
    resp = real_tp_app.handle.generate.remote(
        GenerateRequest(model="smollm2-tp3", prompt=prompt, max_tokens=16)).result()
    assert resp.token_ids == ref.greedy(ref.ids(prompt), 16)
