"""Turning user text into target token ids: plain prompts, chat-templated prompts, prompt files."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import RequestError


def encode_prompt(tokenizer, text: str, chat: bool, system: str | None = None) -> list[int]:
    """Token ids for one prompt; with `chat`, the tokenizer's chat template with a generation prompt."""
    if not text.strip():
        raise RequestError("prompt is empty")
    if chat:
        return encode_messages(tokenizer, ([{"role": "system", "content": system}] if system else [])
                               + [{"role": "user", "content": text}])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model has no chat template: send a plain prompt instead")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
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
