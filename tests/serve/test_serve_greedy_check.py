"""The served load run's greedy check (`s2d bench serve --check-greedy`, tests/serve/scaleout_run.py) on real Ray Serve
(127.0.0.1) with tiny float64 models: responses carry their token ids (`return_token_ids`), the check finds them all
equal to in-process greedy, and it reports a changed or missing token where it is (the check can fail)."""

from __future__ import annotations

import asyncio
import copy

import pytest

from serve_helpers import API_KEY, post

pytestmark = pytest.mark.serve

PROMPTS = ["What is the capital of France?", "def add(a, b):", "The quick brown fox", "Translate to German: good"]


@pytest.fixture(scope="module")
def load_result(tiny_app) -> dict:
    from s2d_ray.bench.serve import LoadRun, run_load

    run = LoadRun(tiny_app.url, "tiny-a", [4], requests=8, max_tokens=16, temperature=0.0, api_key=API_KEY,
                  return_token_ids=True)
    return asyncio.run(run_load(run, PROMPTS))


@pytest.fixture(scope="module")
def greedy_check(tiny_family):
    from s2d_ray.bench.greedy_check import GreedyCheck
    from s2d_ray.config import EngineConfig, TargetConfig

    engine = EngineConfig(target=TargetConfig(name="tiny-a", source=str(tiny_family["a"]), dtype="float64"),
                          num_threads=1)
    return GreedyCheck(engine, batch=3)


def test_token_ids_extension(tiny_app):
    body = {"model": "tiny-a", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    plain = post(f"{tiny_app.url}/v1/completions", body).json()["choices"][0]
    with_ids = post(f"{tiny_app.url}/v1/completions", {**body, "return_token_ids": True}).json()
    assert "token_ids" not in plain  # off by default: the OpenAI shape is unchanged
    choice = with_ids["choices"][0]
    assert choice["text"] == plain["text"] and len(choice["token_ids"]) == with_ids["usage"]["completion_tokens"]


def test_check_passes_on_served_greedy(load_result, greedy_check):
    from s2d_ray.bench.greedy_check import check_greedy, greedy_markdown

    rows = load_result["requests"]["4"]
    assert len(rows) == 8 and all(r["ok"] and r["token_ids"] for r in rows)
    assert sorted(r["prompt_index"] for r in rows) == [0, 0, 1, 1, 2, 2, 3, 3]
    out = check_greedy(load_result, PROMPTS, greedy_check)
    assert (out["checked"], out["equal"], out["differing"], out["unchecked"], out["passed"]) == (8, 8, 0, 0, True)
    assert "8 equal" in greedy_markdown(out) and "PASSED" in greedy_markdown(out)


def test_check_reports_a_changed_and_a_missing_token(load_result, greedy_check, tiny_family):
    """Negative control: the same responses with one token changed (position 5) and one cut short fail the check,
    each at its position, with the target's top-2 logit gap there; a response without ids is counted unchecked."""
    from s2d_ray.bench.greedy_check import check_greedy

    bad = copy.deepcopy(load_result)
    rows = bad["requests"]["4"]
    by_index = {r["prompt_index"]: r for r in rows}  # one response of each prompt
    changed, cut, no_ids = by_index[0], by_index[1], by_index[2]
    original = changed["token_ids"][5]
    changed["token_ids"][5] = (original + 1) % 64
    cut["token_ids"] = cut["token_ids"][:-1]
    no_ids["token_ids"] = None
    out = check_greedy(bad, PROMPTS, greedy_check)
    assert (out["checked"], out["equal"], out["differing"], out["unchecked"], out["passed"]) == (7, 5, 2, 1, False)
    first, second = sorted(out["differences"], key=lambda d: d["prompt_index"])
    assert (first["index"], first["reference_token"], first["method_token"]) == (5, original, (original + 1) % 64)
    assert first["top2_gap"] > 0 and first["pair_gap"] > 0 and not first["near_tie"]
    assert (second["index"], second["method_token"]) == (len(cut["token_ids"]), None)
