"""The mt-bench workload of `s2d bench serve`: turn 2 is sent after turn 1's answer and carries it; its TTFT is
reported apart; the chats come from S2D_DATA_DIR, with built-in ones without it."""

from __future__ import annotations

import asyncio
import json

from s2d_ray.bench.mt_bench import FALLBACK_CHATS, TwoTurns, mt_bench_chats, two_turns
from s2d_ray.bench.serve import RequestResult, level_summary, workload_prompts


def test_turn_two_carries_turn_one_and_its_answer():
    sent: list[str] = []

    async def send(prompt: str) -> RequestResult:
        sent.append(prompt)
        return RequestResult(True, 0.5, ttft=0.1 * len(sent), tokens=3, text=f" answer{len(sent)}")

    chat = TwoTurns("Hi?", "And then?")
    first, second = asyncio.run(two_turns(send, chat))
    assert (first.turn, second.turn) == (1, 2)
    assert sent[1].startswith(sent[0] + " answer1") and sent[1].endswith("User: And then?\nAssistant:")
    summary = level_summary(1, [first, second], 1.0)
    assert summary["turn2_completed"] == 1 and abs(summary["turn2_ttft_ms_p50"] - 200.0) < 1e-6
    assert "turn2_ttft_ms_p50" not in level_summary(1, [RequestResult(True, 0.5, ttft=0.1, tokens=3)], 1.0)

    async def failing(prompt: str) -> RequestResult:
        return RequestResult(False, 0.1, error="HTTP 503")

    assert len(asyncio.run(two_turns(failing, chat))) == 1  # no turn 2 without turn 1's answer


def test_chats_from_the_data_directory_or_built_in(tmp_path, monkeypatch):
    from s2d_ray import config

    monkeypatch.setattr(config, "DATA_DIR", None)  # read from S2D_DATA_DIR at import
    assert workload_prompts("mt-bench", ["ignored"]) == [TwoTurns(*t) for t in FALLBACK_CHATS]
    questions = tmp_path / "fastchat" / "mt_bench" / "question.jsonl"
    questions.parent.mkdir(parents=True)
    questions.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"q{i}", f"f{i}"]}) for i in range(3)))
    monkeypatch.setattr(config, "DATA_DIR", tmp_path)
    assert mt_bench_chats() == [TwoTurns(f"q{i}", f"f{i}") for i in range(3)]
