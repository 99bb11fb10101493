"""Training data for SoFT: instruction rows, ShareGPT conversations or self-distilled token rows -> packed batches.

Every example is rendered with the target's chat template; only assistant tokens carry loss. Examples are packed
into fixed-length sequences with per-document positions and a block-diagonal causal mask, so each token sees
exactly what it would see at inference (its own conversation from position 0). The held-out split is a stable
hash of the instruction, so it never changes with the seed or the file order.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..errors import ConfigError

logger = logging.getLogger(__name__)

HELDOUT_PERCENT = 2
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def is_heldout(key: str, percent: int = HELDOUT_PERCENT) -> bool:
    """A stable ~percent% of instructions, chosen by hash (independent of seed and file order)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100 < percent


def row_key(row: dict) -> str:
    return row.get("instruction") or json.dumps(row.get("conversations", row.get("prompt_ids", "")))


def data_files(path: Path) -> list[Path]:
    """A data file, or a self-distilled directory's chunk files in order (see selfdistill.py)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"training data {path} does not exist")
    return sorted(path.glob("chunk-*.jsonl.gz")) if path.is_dir() else [path]


def read_rows(path: Path) -> Iterator[dict]:
    """JSONL rows (plain or .gz), a JSON list (ShareGPT dumps) or a chunk directory; each gets an `id` if none."""
    path = Path(path)
    files = data_files(path)
    if path.is_dir():
        for f in files:
            yield from read_rows(f)
        return
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    if text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(x) for x in text.splitlines() if x.strip()]
    for n, row in enumerate(rows):
        row.setdefault("id", f"{path.stem}/{n}")
        yield row


def data_hash(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for f in (f for p in paths for f in data_files(p)):
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def messages_of(row: dict) -> list[dict]:
    """Chat messages of an instruction row or a ShareGPT conversation."""
    if "conversations" in row:
        return [{"role": ROLE_MAP[m.get("from", m.get("role"))], "content": m.get("value", m.get("content", ""))}
                for m in row["conversations"]]
    if "instruction" in row:
        user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        msgs = [{"role": "user", "content": user}]
        return msgs + ([{"role": "assistant", "content": row["response"]}] if row.get("response") is not None else [])
    raise ConfigError(f"row {row.get('id')} has neither `instruction` nor `conversations` nor token ids")


def _template(tok, messages: list[dict], gen_prompt: bool) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=True, return_dict=False)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def render_prompt(tok, row: dict) -> list[int]:
    """Prompt ids up to the first assistant turn, with the generation prompt (what the target is asked)."""
    msgs = messages_of(row)
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    return _template(tok, msgs[:first], True)


def render_example(tok, row: dict) -> tuple[list[int], list[bool]]:
    """(ids, loss mask): self-distilled rows use their stored ids; chat rows are templated turn by turn."""
    if "response_ids" in row:
        p, r = row["prompt_ids"], row["response_ids"]
        return p + r, [False] * len(p) + [True] * len(r)
    msgs = messages_of(row)
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = _template(tok, msgs[:i], True)
        full = _template(tok, msgs[: i + 1], False)
        if full[: len(before)] != before or ids != before[: len(ids)]:
            raise ConfigError(f"row {row.get('id')}: chat template is not prefix-stable; cannot mask assistant turns")
        mask += [False] * (len(before) - len(ids)) + [True] * (len(full) - len(before))
        ids = full
    return ids, mask


@dataclass
class Packed:
    """One batch: ids [B, S], labels [B, S] (-100 = no loss), positions [B, S], doc [B, S] (document index);
    row [B]: each row's index in the packed list (what a KD cache is keyed by)."""

    ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    doc: torch.Tensor
    row: torch.Tensor | None = None

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive [B, 1, S, S] mask: causal within each packed document, nothing across documents (on the batch's
        device)."""
        s = self.ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=self.doc.device).tril()
        allowed = causal[None] & (self.doc[:, :, None] == self.doc[:, None, :])
        out = torch.zeros(allowed.shape, dtype=dtype, device=self.doc.device)
        return out.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]

    def to(self, device: torch.device | str) -> "Packed":
        """The batch on `device` (itself when it is there already)."""
        if self.ids.device == torch.device(device):
            return self
        return Packed(*(None if t is None else t.to(device)
                        for t in (self.ids, self.labels, self.positions, self.doc, self.row)))


def pack(examples: list[tuple[list[int], list[bool]]], seq_len: int) -> list[Packed]:
    """Greedy packing into rows of seq_len; a long example is cut into windows. Labels are next tokens."""
    rows: list[list[tuple[int, bool, int, int]]] = [[]]
    for d, (ids, mask) in enumerate(examples):
        for start in range(0, max(len(ids) - 1, 1), seq_len):
            piece = list(zip(ids[start : start + seq_len + 1], mask[start : start + seq_len + 1]))
            if not any(m for _, m in piece[1:]):
                continue
            if len(rows[-1]) + len(piece) - 1 > seq_len:
                rows.append([])
            # (token, label-mask of the NEXT token, position, doc); the last item only provides a label
            rows[-1] += [(t, piece[j + 1][1], start + j, d) + (piece[j + 1][0],) for j, (t, _) in enumerate(piece[:-1])]
    out = []
    for r in rows:
        if not r:
            continue
        pad = seq_len - len(r)
        ids = [x[0] for x in r] + [0] * pad
        labels = [x[4] if x[1] else -100 for x in r] + [-100] * pad
        pos = [x[2] for x in r] + list(range(pad))
        doc = [x[3] for x in r] + [-1] * pad
        out.append(Packed(*(torch.tensor([v]) for v in (ids, labels, pos, doc, len(out)))))
    return out


def stack_rows(rows: list[Packed]) -> Packed:
    """Packed rows stacked into one batch (row indices kept)."""
    return Packed(*(torch.cat([getattr(p, f) for p in rows]) for f in ("ids", "labels", "positions", "doc", "row")))


def visit_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order an epoch visits n packed rows (seeded per epoch): batches take it batch_size at a time."""
    order = list(range(n))
    random.Random(seed * 1000 + epoch).shuffle(order)
    return order


def batches(rows: list[Packed], batch_size: int, seed: int, epoch: int) -> list[Packed]:
    """Shuffle packed rows (seeded per epoch) and stack them into batches."""
    order = visit_order(len(rows), seed, epoch)
    out = []
    for s in range(0, len(order) - batch_size + 1, batch_size):
        pick = [rows[i] for i in order[s : s + batch_size]]
        out.append(stack_rows(pick))
    return out


def load_examples(paths: list[Path], tok, split: str, limit: int | None = None,
                  sources: list[str] | None = None, seed: int | None = None) -> list[tuple[list[int], list[bool]]]:
    """Render the rows of `split` ("train" | "heldout"), optionally only rows whose source starts with a prefix;
    with `seed`, a seeded random `limit` of them (files are grouped by source, so the first N would be biased)."""
    rows = [row for path in paths for row in read_rows(path)
            if (not sources or any(str(row.get("source", "")).startswith(s) for s in sources))
            and is_heldout(row_key_for_split(row)) == (split == "heldout")]
    if seed is not None:
        random.Random(seed).shuffle(rows)
    return [render_example(tok, row) for row in rows[:limit]]


def row_key_for_split(row: dict) -> str:
    """Self-distilled rows carry the id of their instruction row; split them by that row's instruction text."""
    return row.get("split_key") or row_key(row)


def check_token_rows(paths: list[Path], tok, flag_target: str, sample: int = 16) -> None:
    """Refuse self-distilled rows (stored token ids) made with another tokenizer than `tok`'s: an id outside it, or a
    prompt that this tokenizer would not encode to the same ids (a prompt is the chat template's text tokenised, so
    the same tokenizer gives back exactly its ids). The first `sample` token rows are checked."""
    size, seen = len(tok), 0
    for path in paths:
        for row in read_rows(path):
            if "prompt_ids" not in row:
                continue
            ids, prompt = row["prompt_ids"] + row.get("response_ids", []), row["prompt_ids"]
            again = tok(tok.decode(prompt), add_special_tokens=False)["input_ids"]
            if max(ids, default=0) >= size or again != prompt:
                made = f" (made by {row['target']})" if row.get("target") else ""
                raise ConfigError(f"--data {path}: row {row.get('id')}{made} was tokenised with another tokenizer than "
                                  f"--target {flag_target}'s ({size} ids); use data generated by this target's family")
            seen += 1
            if seen >= sample:
                return
