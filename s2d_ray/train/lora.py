"""A second target with the same tokenizer: SmolLM2-135M-Instruct + a LoRA adapter fitted to GSM8K train rows,
and a greedy GSM8K accuracy check through the one engine (`ar` mode), so base and fine-tune are measured alike.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..build import build_engine
from ..config import EngineConfig, SpecConfig, TargetConfig
from ..core.engine import GenerationRequest
from ..core.types import SamplingParams
from ..models import load_model
from ..prompts import encode_prompt
from .data import load_examples

logger = logging.getLogger(__name__)
ANSWER = re.compile(r"####\s*\$?(-?[\d,]*\.?\d+)")
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def train_lora(base: str, data: Path, out: Path, steps: int, batch_size: int = 8, lr: float = 2e-4,
               rank: int = 16, max_len: int = 320, seed: int = 0,
               sources: tuple[str, ...] = ("gsm8k_train",)) -> dict:
    """LoRA (q, k, v, o, up, down, gate) on the rows of `sources` (source-name prefixes) no longer than `max_len`
    tokens; loss on assistant tokens; saves a peft adapter."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lm = load_model(base, dtype=torch.float32)
    examples = load_examples([data], lm.tokenizer, "train", sources=list(sources))
    examples = [e for e in examples if len(e[0]) <= max_len]
    if not examples:
        raise ValueError(f"no train rows of sources {list(sources)} fit in {max_len} tokens")
    # The adapter names its base by the project's model name (what `NamedSource.base` resolves), not by the path of
    # the converted model on this machine.
    model = get_peft_model(lm.model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                base_model_name_or_path=base,
                                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - s / steps))
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(examples), generator=gen).tolist()
    started, losses = time.perf_counter(), []
    for step in (bar := tqdm(range(steps), desc="LoRA")):
        pick = [examples[order[(step * batch_size + i) % len(order)]] for i in range(batch_size)]
        ids, labels, attn = _pad(pick)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    name_base(out, base)
    info = {"base": base, "sources": list(sources), "max_len": max_len, "steps": steps, "batch_size": batch_size,
            "lr": lr, "rank": rank, "seed": seed,
            "examples_seen": steps * batch_size, "wall_s": round(time.perf_counter() - started, 1),
            "loss_first20": _mean(losses[:20]), "loss_last20": _mean(losses[-20:])}
    (out / "TRAINING.json").write_text(json.dumps(info, indent=2))
    return info


def name_base(out: Path, base: str) -> None:
    """Name the base by the project's model name in the saved adapter_config.json (peft writes the path the base was
    loaded from, which is this machine's cache) and drop the model card peft writes (an empty template)."""
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def _pad(pick: list[tuple[list[int], list[bool]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in pick)
    ids = torch.zeros(len(pick), width, dtype=torch.long)
    labels = torch.full((len(pick), width), -100, dtype=torch.long)
    attn = torch.zeros(len(pick), width, dtype=torch.long)
    for i, (toks, mask) in enumerate(pick):
        ids[i, : len(toks)] = torch.tensor(toks)
        attn[i, : len(toks)] = 1
        labels[i, : len(toks)] = torch.tensor([t if m else -100 for t, m in zip(toks, mask)])
    return ids, labels, attn


def extract_answer(text: str) -> str | None:
    """The `#### N` answer if present, else the last number in the text (commas dropped)."""
    m = ANSWER.search(text)
    nums = [m.group(1)] if m else NUMBER.findall(text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def gsm8k_accuracy(target: str, test_file: Path, n: int, max_new_tokens: int = 256, batch: int = 16,
                   threads: int | None = None, dtype: str = "float32") -> dict:
    """Greedy accuracy on the first n problems of test_file, decoded with the one engine in `ar` mode."""
    rows = [json.loads(x) for x in test_file.read_text().splitlines() if x.strip()][:n]
    cfg = EngineConfig(target=TargetConfig(name=target, dtype=dtype), spec=SpecConfig(mode="ar"), num_threads=threads)
    built = build_engine(cfg)
    tok = built.target.tokenizer
    correct, outputs = 0, []
    for s in range(0, len(rows), batch):
        chunk = rows[s : s + batch]
        reqs = [GenerationRequest(f"g{s + i}", encode_prompt(tok, r["question"], True), max_new_tokens,
                                  SamplingParams(), (tok.eos_token_id,)) for i, r in enumerate(chunk)]
        for r, res in zip(chunk, built.engine.generate(reqs)):
            pred = extract_answer(tok.decode(res.token_ids, skip_special_tokens=True))
            gold = extract_answer(r["answer"])
            correct += int(pred is not None and gold is not None and float(pred) == float(gold))
            outputs.append({"pred": pred, "gold": gold})
    return {"target": target, "dtype": dtype, "n": len(rows), "correct": correct,
            "accuracy": correct / max(len(rows), 1), "outputs": outputs}
