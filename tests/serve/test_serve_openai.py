"""OpenAI API parity over real Ray Serve (127.0.0.1, tiny float64 models behind S2D): logprobs equal to a plain HF
forward of the target, echo with prompt logprobs (what lm-evaluation-harness sends), prompt batches, n > 1 seeded and
reproducible, the `openai` client streamed and not, and no leak when a client drops n streams."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from serve_helpers import API_KEY, AUTH, HTTP_TIMEOUT, Reference, post, sse_events, wait_until

pytestmark = pytest.mark.serve

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def ref(tiny_family) -> Reference:
    return Reference(str(tiny_family["a"]), "float64")


@pytest.fixture(scope="module")
def hf(tiny_family):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_family["a"], dtype=torch.float64).eval()


def raw_logp(hf, ids: list[int]) -> torch.Tensor:
    """Row j: log_softmax of a plain forward, the distribution of token j + 1 (greedy requests report raw logprobs)."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)


def completions(app, **body) -> dict:
    r = post(f"{app.url}/v1/completions", {"model": "tiny-a", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_logprobs_equal_a_plain_target_forward(tiny_app, ref, hf):
    body = completions(tiny_app, prompt=PROMPT, max_tokens=20, logprobs=3)
    choice = body["choices"][0]
    ids = ref.ids(PROMPT)
    out = ref.greedy(ids, 20)
    lp = choice["logprobs"]
    logp = raw_logp(hf, ids + out)[len(ids) - 1:]
    assert lp["tokens"] == [ref.tok.decode([t]) for t in out]
    assert lp["token_logprobs"] == pytest.approx([float(logp[j, t]) for j, t in enumerate(out)], abs=1e-9)
    for j, top in enumerate(lp["top_logprobs"]):
        values, top_ids = torch.topk(logp[j], 3)
        expected = {ref.tok.decode([i]): v for i, v in zip(top_ids.tolist(), values.tolist())}
        expected[lp["tokens"][j]] = lp["token_logprobs"][j]  # the chosen token is always listed
        assert top == pytest.approx(expected, abs=1e-9)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert body["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0  # speculation was on


def test_echo_scores_token_id_prompts_like_lm_eval(tiny_app, ref, hf):
    """lm-eval's loglikelihood request: a batch of token-id prompts, echo, logprobs 1, max_tokens 1 (or 0)."""
    prompts = [ref.ids(PROMPT), ref.ids("def add(a, b):")]
    for max_tokens in (0, 1):
        body = completions(tiny_app, prompt=prompts, max_tokens=max_tokens, logprobs=1, echo=True, seed=1234)
        assert [c["index"] for c in body["choices"]] == [0, 1]
        for ids, choice in zip(prompts, body["choices"]):
            lp = choice["logprobs"]
            n_gen = len(lp["tokens"]) - len(ids)
            assert n_gen == max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            logp = raw_logp(hf, ids)
            assert lp["token_logprobs"][1:len(ids)] == pytest.approx(
                [float(logp[j, t]) for j, t in enumerate(ids[1:])], abs=1e-9)
            assert choice["text"].startswith(ref.tok.decode(ids))
            # lm-eval's is_greedy: the chosen logprob is the max of its top dict exactly when it is the argmax.
            for j, (tok, top) in enumerate(zip(lp["token_logprobs"][1:len(ids)], lp["top_logprobs"][1:len(ids)])):
                assert (tok == max(top.values())) == (int(logp[j].argmax()) == ids[j + 1])
        assert body["usage"]["completion_tokens"] == max_tokens * 2
        assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_echoed_prompt_top_logprobs_equal_a_plain_target_forward(tiny_app, ref, hf):
    """The prompt's top-n, reduced on the target replica (only P x n numbers reach the router), equal a plain HF
    forward's: each prompt token's logprob and its top-3 alternatives."""
    ids = ref.ids("def add(a, b): return a + b  # the quick brown fox")
    lp = completions(tiny_app, prompt=ids, max_tokens=0, logprobs=3, echo=True)["choices"][0]["logprobs"]
    logp = raw_logp(hf, ids)
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    for j, (tok, top) in enumerate(zip(ids[1:], lp["top_logprobs"][1:])):
        assert lp["token_logprobs"][j + 1] == pytest.approx(float(logp[j, tok]), abs=1e-9)
        values, top_ids = torch.topk(logp[j], 3)
        expected = {ref.tok.decode([i]): v for i, v in zip(top_ids.tolist(), values.tolist())}
        expected.setdefault(ref.tok.decode([tok]), float(logp[j, tok]))  # the prompt's own token is listed too
        assert top == pytest.approx(expected, abs=1e-9)


def test_stream_logprobs_and_echo_concatenate_to_the_full_response(tiny_app):
    req = {"model": "tiny-a", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 2, "echo": True}
    full = completions(tiny_app, **req)["choices"][0]
    chunks = sse_events(f"{tiny_app.url}/v1/completions", req)[:-1]
    parts = [c["choices"][0] for c in chunks]
    assert "".join(p["text"] for p in parts) == full["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p["logprobs"][key]] == full["logprobs"][key]


def test_prompt_batch_has_one_choice_per_prompt_in_order(tiny_app, ref):
    prompts = [PROMPT, "def add(a, b):", "Translate to German: good"]
    body = completions(tiny_app, prompt=prompts, max_tokens=12)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for p, c in zip(prompts, body["choices"]):
        assert c["text"] == ref.text(ref.greedy(ref.ids(p), 12))


def test_n_seeded_samples_are_independent_and_reproducible(tiny_app):
    req = {"model": "tiny-a", "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "n": 4, "seed": 11}
    first, again = completions(tiny_app, **req), completions(tiny_app, **req)
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1  # independent streams, not one sample copied n times
    # Choice i uses seed + i: the same as a single request with that seed.
    solo = completions(tiny_app, **{**req, "n": 1, "seed": 13})
    assert solo["choices"][0]["text"] == texts[2]
    streamed = sse_events(f"{tiny_app.url}/v1/completions", req)
    assert streamed[-1] == "[DONE]" and streamed[-2]["choices"] == []
    joined = ["".join(c["choices"][0]["text"] for c in streamed[:-2] if c["choices"][0]["index"] == i)
              for i in range(4)]
    assert joined == texts
    assert streamed[-2]["usage"] == first["usage"]


def test_n_choices_prefill_a_long_prompt_once(tiny_app, ref):
    """n choices of a long prompt: the target copies one row's prompt KV into the others (forked tokens in /stats),
    and every choice still equals a single request with its seed."""
    prompt = " ".join(f"item {i} is {i * 7 % 13};" for i in range(12))
    assert len(ref.ids(prompt)) > 40

    def forked() -> int:
        health = httpx.get(f"{tiny_app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()
        return health["targets"]["tiny-a"]["deployment"]["num_forked_tokens"]

    before = forked()
    req = {"model": "tiny-a", "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 5}
    texts = [c["text"] for c in completions(tiny_app, **req)["choices"]]
    assert forked() - before >= 2 * (len(ref.ids(prompt)) - 1)
    assert [completions(tiny_app, **{**req, "n": 1, "seed": 5 + i})["choices"][0]["text"] for i in range(3)] == texts


def test_handle_api_sampled_logprobs_are_of_the_sampling_distribution(tiny_app, ref, hf):
    """temperature / top-k as the sampler applied them, through the Python handle (token ids, not strings)."""
    from s2d_ray.core.sampling import logits_to_probs
    from s2d_ray.core.types import SamplingParams
    from s2d_ray.serve.openai_protocol import GenerateRequest

    params = SamplingParams(temperature=0.7, top_k=5, seed=3)
    req = GenerateRequest(model="tiny-a", prompt=PROMPT, max_tokens=12, temperature=0.7, top_k=5, seed=3,
                          logprobs=8, prompt_logprobs=True)
    resp = tiny_app.handle.generate.remote(req).result()
    ids = ref.ids(PROMPT)
    assert resp.prompt_token_ids == ids and resp.prompt_logprobs[0] is None
    with torch.no_grad():
        logits = hf(torch.tensor([ids + resp.token_ids])).logits[0, :-1]
    expected = logits_to_probs(logits, params).log()  # [len - 1, V]; -inf past top-k
    rows = [(lp, len(ids) - 1 + j) for j, lp in enumerate(resp.logprobs)]
    rows += [(lp, j) for j, lp in enumerate(resp.prompt_logprobs[1:])]
    for lp, row in rows:
        assert lp.logprob == pytest.approx(float(expected[row, lp.token]), abs=1e-9)
        values, top_ids = torch.topk(expected[row], 8)
        assert [i for i, _ in lp.top][:5] == top_ids.tolist()[:5]
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-9)
    assert all(lp.top[5][1] == float("-inf") for lp in resp.logprobs)


def test_chat_logprobs_shape_and_values(tiny_app, ref, hf):
    messages = [{"role": "user", "content": "hi there"}]
    req = {"model": "tiny-a", "messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True,
           "top_logprobs": 2}
    r = post(f"{tiny_app.url}/v1/chat/completions", req)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    ids = ref.ids(messages=messages)
    out = ref.greedy(ids, 10)
    logp = raw_logp(hf, ids + out)[len(ids) - 1:]
    assert [c["token"] for c in content] == [ref.tok.decode([t]) for t in out]
    assert [c["logprob"] for c in content] == pytest.approx([float(logp[j, t]) for j, t in enumerate(out)])
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode()) for c in content)
    chunks = sse_events(f"{tiny_app.url}/v1/chat/completions", req)[:-1]
    assert [x for c in chunks for x in c["choices"][0]["logprobs"]["content"]] == content


def test_openai_client_logprobs_n_echo_streamed_and_not(tiny_app, ref):
    import openai

    client = openai.OpenAI(base_url=f"{tiny_app.url}/v1", api_key=API_KEY, timeout=120)
    c = client.completions.create(model="tiny-a", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, echo=True)
    assert c.choices[0].text.startswith(PROMPT) and c.choices[0].logprobs.token_logprobs[0] is None
    c = client.completions.create(model="tiny-a", prompt=[PROMPT, "hello"], max_tokens=6, temperature=0.8, n=2,
                                  seed=5)
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2, 3]
    parts: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny-a", prompt=PROMPT, max_tokens=6, temperature=0.8, n=2,
                                           seed=5, stream=True, logprobs=1):
        for ch in chunk.choices:
            parts[ch.index] = parts.get(ch.index, "") + ch.text
    assert parts == {0: c.choices[0].text, 1: c.choices[1].text}
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny-a", messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="tiny-a", messages=messages, max_tokens=6, temperature=0, logprobs=True, stream=True) if ch.choices)
    assert streamed == chat.choices[0].message.content
    by_index: dict[int, list] = {0: [], 1: []}  # chat, streamed, n = 2, with logprobs
    for chunk in client.chat.completions.create(model="tiny-a", messages=messages, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=3, n=2, stream=True):
        for ch in chunk.choices:
            by_index[ch.index].append(ch)
    for i, chunks in by_index.items():
        assert "".join(ch.delta.content or "" for ch in chunks) == chat.choices[i].message.content
        streamed_lp = [e for ch in chunks if ch.logprobs for e in ch.logprobs.content]
        assert [e.logprob for e in streamed_lp] == [e.logprob for e in chat.choices[i].logprobs.content]


def test_client_hanging_up_mid_n_streams_frees_everything(tiny_app):
    """Greedy, 400 tokens: no choice can end early (the target's greedy text has no EOS that soon) and the
    generation outlasts the stats call on a fast host; sampled choices could stop at EOS before the check."""
    body = {"model": "tiny-a", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "n": 4, "stream": True,
            "logprobs": 2, "stop": ["never-in-tiny-text-xyz"]}
    with httpx.stream("POST", f"{tiny_app.url}/v1/completions", content=json.dumps(body),
                      headers={"content-type": "application/json", **AUTH}, timeout=HTTP_TIMEOUT) as resp:
        assert resp.status_code == 200
        next(line for line in resp.iter_lines() if line.startswith("data:"))
        stats = tiny_app.handle.stats.remote().result()["targets"]["tiny-a"]
        assert stats["running"] == 4 and stats["deployment"]["num_active"] == 4  # all n were live
    # Connection closed mid-generation: every one of the n sequences is aborted and its KV freed.

    def freed():
        s = tiny_app.handle.stats.remote().result()
        t = s["targets"]["tiny-a"]
        return t["running"] == 0 and t["waiting"] == 0 and t["deployment"]["num_active"] == 0 \
            and s["draft"]["num_active"] == 0

    wait_until(freed, timeout_s=30)
