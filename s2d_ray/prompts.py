"""Turning user text into target token ids: plain prompts, chat-templated prompts, prompt files, and the
Spec-Bench question files that benchmarks and cost measurements draw their prompts from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, RequestError

TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")  # Spec-Bench's six
MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                 "humanities"})


def encode_prompt(tokenizer, text: str, chat: bool, system: str | None = None) -> list[int]:
    """Token ids for one prompt; with `chat`, the tokenizer's chat template with a generation prompt. A plain prompt
    starts with BOS where the tokenizer's config asks for one (`add_bos_token`, as Llama-2's does): a Llama-2 model
    fed no BOS continues text it was never trained on. Never EOS (a prompt is continued, not ended)."""
    if not text.strip():
        raise RequestError("prompt is empty")
    if chat:
        return encode_messages(tokenizer, ([{"role": "system", "content": system}] if system else [])
                               + [{"role": "user", "content": text}])
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and ids[:1] != [bos]:
        ids.insert(0, bos)
    return ids


def override_chat_template(tokenizer, template: str | None) -> None:
    """Give the tokenizer the configured chat template: a Jinja string, or the path of a file that holds one (for
    models that ship none, such as Vicuna v1.5, or ship one the operator does not want). None keeps the model's."""
    if template is None:
        return
    path = Path(template).expanduser()
    if "{" not in template and not path.is_file():
        raise ConfigError(f"chat_template {template!r} is neither a Jinja template nor a readable file")
    tokenizer.chat_template = path.read_text() if "{" not in template else template


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model has no chat template: send a plain prompt instead")
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]


def read_prompt_file(path: Path) -> list[str]:
    """One prompt per line, or JSONL with a `prompt` field (blank lines skipped)."""
    if not path.exists():
        raise RequestError(f"prompt file {path} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RequestError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
            if not isinstance(row.get("prompt"), str):
                raise RequestError(f"{path}:{n}: JSONL rows need a string `prompt` field")
            prompts.append(row["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise RequestError(f"prompt file {path} holds no prompts")
    return prompts


# --- Spec-Bench question files ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str  # the row's own category (MT-Bench has eight)
    task: str  # one of Spec-Bench's six tasks
    turns: tuple[str, ...]


def task_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def read_questions(path: Path) -> list[Question]:
    """Spec-Bench rows (question_id, category, turns), or the held-out path files of data/draftq/heldout (id,
    split_key: the instruction), which become one-turn questions of the task `heldout`."""
    if not path.exists():
        raise ConfigError(f"questions file {path} does not exist (pass --questions PATH)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "turns" not in row and "split_key" in row:  # a held-out path: its instruction is the question
                row = {"question_id": row["id"], "category": "heldout", "turns": [row["split_key"]]}
            turns = tuple(str(t) for t in row["turns"])
            rows.append(Question(row["question_id"], str(row["category"]), task_of(str(row["category"])), turns))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{n}: not a Spec-Bench row with question_id, category, turns ({exc})") from None
        if not turns:
            raise ConfigError(f"{path}:{n}: `turns` is empty")
    return rows


def select_questions(rows: list[Question], per_category: int | None, tasks: list[str] | None = None) -> list[Question]:
    """Evenly spaced picks per task (so MT-Bench's eight sub-categories all appear), tasks interleaved in order."""
    by_task: dict[str, list[Question]] = {}
    for q in rows:
        by_task.setdefault(q.task, []).append(q)
    wanted = tasks or [t for t in TASKS if t in by_task] + sorted(set(by_task) - set(TASKS))
    unknown = [t for t in wanted if t not in by_task]
    if unknown:
        raise ConfigError(f"no questions for categories {unknown}; the file has {sorted(by_task)}")
    picked = {}
    for t in wanted:
        qs = by_task[t]
        n = len(qs) if per_category is None else min(per_category, len(qs))
        picked[t] = [qs[(i * len(qs)) // n] for i in range(n)]
    out = []
    for i in range(max(len(v) for v in picked.values())):
        out.extend(picked[t][i] for t in wanted if i < len(picked[t]))
    return out


def sample_prompts(tokenizer, questions: Path | None, n: int) -> list[list[int]]:
    """`n` chat-templated first turns of Spec-Bench questions from different tasks; without a question file,
    synthetic text (for measurements whose cost depends on the prompts' length, not on their words)."""
    if questions is not None:
        texts = [q.turns[0] for q in select_questions(read_questions(questions), 1)][:n]
    else:
        texts = [f"Explain, step by step, how a speculative decoder verifies draft tokens (variant {i})."
                 for i in range(n)]
    return [encode_messages(tokenizer, [{"role": "user", "content": t}]) for t in texts]
