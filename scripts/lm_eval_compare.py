"""Compare lm-evaluation-harness runs sample by sample: served (OUT/served/<model>) vs in-process (OUT/hf-<dtype>/<src>,
and OUT/engine-ar/<model>.jsonl: `s2d generate --mode ar` over the same GSM8K prompts).

Run by scripts/lm_eval_acceptance.sh; prints a Markdown table. Loglikelihood tasks: the largest absolute
difference of any request's loglikelihood, `is_greedy` and the prediction per question; generate tasks: how many
generations are identical, character for character, and where the first difference is.
usage: python scripts/lm_eval_compare.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SOURCE = {"smollm2-135m-gsm8k": "smollm2-135m-gsm8k", "smollm2-135m-instruct": "smollm2-135m-instruct",
          "smollm2-135m-instruct-tp3": "smollm2-135m-instruct"}
TASKS = ("s2d_mc_local", "s2d_gsm8k_local")


def load(run: Path, task: str) -> tuple[dict, dict[int, dict]] | None:
    """(the task's metrics, samples by doc id) of one lm-eval output directory, or None if it has no such task."""
    samples = max(run.rglob(f"samples_{task}_*.jsonl"), default=None)
    results = [r for r in (json.loads(p.read_text())["results"] for p in sorted(run.rglob("results_*.json")))
               if task in r]
    if samples is None or not results:
        return None
    metrics = results[-1][task]
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    return metrics, {r["doc_id"]: r for r in rows}


def _scores(metrics: dict) -> str:
    keep = {k: v for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k}
    return ", ".join(f"{k.replace(',none', '')} {v:.4f}" for k, v in sorted(keep.items()))


def compare_mc(a: dict[int, dict], b: dict[int, dict]) -> str:
    """Largest |loglikelihood difference|, is_greedy and argmax agreement over the docs both runs scored."""
    docs = sorted(a.keys() & b.keys())
    worst, greedy_same, pred_same, n_req = 0.0, 0, 0, 0
    for d in docs:
        la = [r[0] for r in a[d]["resps"]]
        lb = [r[0] for r in b[d]["resps"]]
        for (lla, ga), (llb, gb) in zip(la, lb):
            worst = max(worst, abs(float(lla) - float(llb)))
            greedy_same += bool(ga) == bool(gb)
            n_req += 1
        pa = max(range(len(la)), key=lambda i: float(la[i][0]))
        pb = max(range(len(lb)), key=lambda i: float(lb[i][0]))
        pred_same += pa == pb
    return (f"{n_req} requests: max abs loglikelihood difference {worst:.2e}, is_greedy equal {greedy_same}/{n_req}, "
            f"predictions equal {pred_same}/{len(docs)}")


def compare_gen(a: dict[int, dict], b: dict[int, dict]) -> str:
    """Identical generations, and the first differing character of each that differs."""
    docs = sorted(a.keys() & b.keys())
    diffs = []
    for d in docs:
        ta, tb = a[d]["resps"][0][0], b[d]["resps"][0][0]
        if ta != tb:
            at = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            diffs.append(f"doc {d} at char {at}")
    out = f"{len(docs) - len(diffs)}/{len(docs)} generations identical"
    return out + (f" (differ: {'; '.join(diffs)})" if diffs else "")


def engine_refs(out: Path, model: str, task: str) -> dict[int, dict] | None:
    """This project's target alone: engine-ll/<model>.jsonl (loglikelihoods, lm-eval's resps shape) or
    engine-ar/<model>.jsonl (`s2d generate --json` over the GSM8K prompts in lm-eval's order)."""
    if task == "s2d_mc_local":
        path = out / "engine-ll" / f"{model}.jsonl"
        wrap = None
    else:
        path = out / "engine-ar" / f"{model}.jsonl"
        wrap = "text"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if wrap is None:
        return {r["doc_id"]: r for r in rows}
    return {d: {"resps": [[r[wrap]]]} for d, r in enumerate(rows)}


def main(out: Path) -> None:
    print("| task | served model | in-process | served scores | in-process scores | per sample |")
    print("|---|---|---|---|---|---|")
    for served in sorted((out / "served").iterdir()):
        for task in TASKS:
            s = load(served, task)
            if s is None:
                continue
            refs = []
            for ref_root in sorted(out.glob("hf-*")):
                ref_dir = ref_root / SOURCE.get(served.name, served.name)
                r = load(ref_dir, task) if ref_dir.is_dir() else None
                if r is not None:
                    refs.append((f"{ref_root.name}/{ref_dir.name}", _scores(r[0]), r[1]))
            engine = engine_refs(out, served.name, task)
            if engine is not None:
                refs.append((f"engine ({'ll' if task == 's2d_mc_local' else 'ar'})", "", engine))
            for label, scores, samples in refs:
                per = compare_mc(s[1], samples) if task == "s2d_mc_local" else compare_gen(s[1], samples)
                print(f"| {task} | {served.name} | {label} | {_scores(s[0])} | {scores} | {per} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
