"""Where served GSM8K generations first differ from the target decoding alone, and how close the target's two best
tokens are there (one forward over the common prefix, fp32 and bf16): a rounding near-tie or not.

Reads OUT/served/<model>/.../samples_s2d_gsm8k_local_*.jsonl and OUT/engine-ar/<model>.jsonl
(scripts/lm_eval_acceptance.sh). usage: python scripts/lm_eval_divergences.py OUT_DIR [MODEL]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from s2d_ray.build import set_threads
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import ScoreRequest
from s2d_ray.models import load_model
from s2d_ray.prompts import encode_prompt


def top2(model, ctx: list[int]) -> tuple[float, list[int]]:
    """(gap between the two best logits, their token ids) after `ctx`."""
    logits = TargetVerifier(model).score([ScoreRequest("x", ctx, 1)])[0][-1].float()
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def main(out: Path, model_name: str) -> None:
    set_threads(1)
    samples = max((out / "served" / model_name).rglob("samples_s2d_gsm8k_local_*.jsonl"))
    served = {json.loads(line)["doc_id"]: json.loads(line)["resps"][0][0] for line in samples.read_text().splitlines()}
    engine = [json.loads(line) for line in (out / "engine-ar" / f"{model_name}.jsonl").read_text().splitlines()]
    models = {"fp32": load_model(model_name, dtype=torch.float32), "bf16": load_model(model_name, dtype=torch.bfloat16)}
    tok = models["fp32"].tokenizer
    gaps = []
    for doc, row in enumerate(engine):
        text, ids = served[doc], row["token_ids"]
        if text == row["text"]:
            continue
        k = next(i for i in range(len(ids) + 1)
                 if i == len(ids) or not text.startswith(tok.decode(ids[: i + 1], skip_special_tokens=True)))
        ctx = encode_prompt(tok, row["prompt"], True) + ids[:k]
        found = {name: top2(m.model, ctx) for name, m in models.items()}
        shown = {name: (round(g, 4), [tok.decode([t]) for t in t2]) for name, (g, t2) in found.items()}
        chose = tok.decode([ids[k]]) if k < len(ids) else "<end>"
        print(f"doc {doc} token {k}: engine chose {chose!r}; top-2 gap fp32 {shown['fp32']}, bf16 {shown['bf16']}")
        gaps.append(round(found["fp32"][0], 4))
    print("fp32 top-2 gaps at the divergences:", sorted(gaps))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "smollm2-135m-gsm8k")
