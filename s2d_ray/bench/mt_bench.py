"""The `mt-bench` workload of `s2d bench serve`: MT-Bench's two-turn chats, turn 2 sent after turn 1's answer and
carrying it (a transcript `User: ... Assistant: <answer> User: ...`), as a chat client does. Turn 2 starts with all of
turn 1 and its answer: what a prefix cache saves, reported as turn 2's TTFT apart from turn 1's."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from ..config import optional_data_file

logger = logging.getLogger(__name__)

MT_BENCH_QUESTIONS = "fastchat/mt_bench/question.jsonl"
FALLBACK_CHATS = (
    ("Write a short poem about the sea.", "Now rewrite it so that every line starts with the letter S."),
    ("Explain what a hash table is.", "Give a Python example that counts words with one."),
    ("Plan a three-day trip to Rome.", "Shorten the plan to a single day, keeping the two best sights."),
    ("What is 17 times 23? Show the steps.", "Now divide that result by 7 and round to two decimals."),
)


@dataclass(frozen=True)
class TwoTurns:
    """One MT-Bench chat: the two user turns."""

    first: str
    second: str

    def prompt(self, answer: str | None = None) -> str:
        """Turn 1's prompt, or with turn 1's answer, turn 2's (which starts with all of turn 1's)."""
        head = f"User: {self.first}\nAssistant:"
        return head if answer is None else f"{head}{answer}\nUser: {self.second}\nAssistant:"


def mt_bench_chats(path: Path | None = None) -> list[TwoTurns]:
    """MT-Bench's chats from `path`, else the data directory's (S2D_DATA_DIR); without either, four built-in ones."""
    path = path or optional_data_file(MT_BENCH_QUESTIONS)
    if path is None:
        logger.warning("no MT-Bench questions (set S2D_DATA_DIR): four built-in two-turn chats")
        return [TwoTurns(*turns) for turns in FALLBACK_CHATS]
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [TwoTurns(r["turns"][0], r["turns"][1]) for r in rows if len(r.get("turns", [])) >= 2]


async def two_turns(send: Callable[[str], Awaitable], chat: TwoTurns) -> list:
    """Turn 1, then turn 2 carrying turn 1's answer (`send(prompt)` -> a RequestResult with `text`); each result
    marked with its turn. A failed turn 1 ends the chat."""
    first = await send(chat.prompt())
    first.turn = 1
    if not first.ok:
        return [first]
    second = await send(chat.prompt(first.text))
    second.turn = 2
    return [first, second]
