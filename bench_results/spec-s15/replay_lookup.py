"""Offline replay of lookup proposals on the greedy outputs a `s2d bench spec` run recorded (no model, no timing).

For every turn, rebuild the prompt as the bench did, then walk the recorded output: each round proposes from
prompt + output so far, accepts the longest proposed prefix that matches the output (greedy, any branch), and
emits one more token. MAT = tokens / rounds; nodes = distinct tree nodes proposed per round. Rules: transformers'
prompt lookup (earliest occurrence, suffix <= 2 tokens, 10 tokens) and the engine's own `find_continuations` with
1..8 continuations. Two methods' outputs of the same run differ where bf16 near-ties broke differently, so replay
both rules on the SAME outputs to compare rules.

    .venv/bin/python bench_results/spec-s15/replay_lookup.py RESULTS.json [METHOD ...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from transformers import AutoTokenizer

from s2d_ray.bench.spec import default_questions_path, read_questions
from s2d_ray.core.lookup import find_continuations
from s2d_ray.models.sources import resolve_model_dir
from s2d_ray.prompts import encode_messages


def hf_rule(tokens: list[int], max_ngram: int = 2, num_tokens: int = 10) -> list[list[int]]:
    """transformers PromptLookupCandidateGenerator: the EARLIEST occurrence of the longest suffix (<= max_ngram)."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), 0, -1):
        suffix = tokens[n_tok - n:]
        for start in range(0, n_tok - n):
            if tokens[start:start + n] == suffix and start + n < n_tok:
                return [tokens[start + n:start + n + num_tokens]]
    return []


def ours(candidates: int, branch_tokens: int = 3):
    return lambda tokens: [m.tokens for m in find_continuations(tokens, 4, 10, candidates, branch_tokens)]


RULES = {"hf-prompt-lookup rule": hf_rule, "ours, 1 continuation": ours(1), "ours, lc2": ours(2),
         "ours, lc4": ours(4), "ours, lc8": ours(8)}


def replay(out: list[int], prompt: list[int], rule) -> tuple[int, int]:
    """(rounds, nodes proposed) to emit `out`."""
    t = rounds = nodes = 0
    while t < len(out):
        conts = rule(prompt + out[:t])
        best = 0
        for c in conts:
            a = 0
            while a < len(c) and t + a < len(out) and c[a] == out[t + a]:
                a += 1
            best = max(best, a)
        nodes += len({tuple(c[:j]) for c in conts for j in range(1, len(c) + 1)})
        t += best + 1
        rounds += 1
    return rounds, nodes


def main(path: str, methods: list[str]) -> None:
    res = json.load(open(path))
    target = res["meta"]["targets"][0]
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(target))
    questions = {int(q.question_id): q for q in read_questions(default_questions_path())}
    recs: dict = defaultdict(dict)
    for r in res["records"]:
        recs[(int(r["question_id"]), int(r["turn"]))][r["method"]] = r
    for method in methods or ["hf-generate"]:
        total = defaultdict(lambda: [0, 0, 0])
        for (qid, turn), by_method in sorted(recs.items()):
            q, conv = questions[qid], []
            for t in range(turn):  # as bench/spec.py: earlier turns answered by the baseline's output
                conv.append({"role": "user", "content": q.turns[t]})
                if t < turn - 1:
                    prev = recs[(qid, t + 1)]["hf-generate"]["token_ids"]
                    conv.append({"role": "assistant", "content": tok.decode(prev, skip_special_tokens=True)})
            prompt, out = encode_messages(tok, conv), by_method[method]["token_ids"]
            for name, rule in RULES.items():
                rounds, nodes = replay(out, prompt, rule)
                cell = total[name]
                cell[0], cell[1], cell[2] = cell[0] + len(out), cell[1] + rounds, cell[2] + nodes
        print(f"{target}, outputs of {method}:")
        for name, (tokens, rounds, nodes) in total.items():
            print(f"  {name:24s} MAT {tokens / rounds:.2f}  nodes/round {nodes / rounds:.1f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
