"""The served loglikelihood requests of an lm-eval run, scored in-process by this project's own target alone.

For every request in OUT/served/<model>/.../samples_<task>_*.jsonl, encode (context, continuation) as lm-eval's
`local-completions` does (trailing context spaces move to the continuation; the whole string is encoded and split
after the context's tokens), run the target verifier over it (no draft, no server, the dtype `serve` resolves) and
write the summed continuation logprob and is_greedy per request to OUT/engine-ll/<model>.jsonl in lm-eval's
`resps` shape, for scripts/lm_eval_compare.py.
usage: python scripts/lm_eval_engine_ll.py OUT_DIR MODEL=SOURCE [MODEL=SOURCE ...] [--dtype auto] [--task NAME]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from s2d_ray.build import set_threads
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import ScoreRequest
from s2d_ray.dtypes import resolve_dtype
from s2d_ray.models import load_model


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair with the huggingface backend (no special tokens)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


@torch.no_grad()
def score(verifier: TargetVerifier, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """(sum of the continuation's logprobs, whether each of its tokens is the argmax), as one fresh sequence."""
    ids = ctx + cont
    logits = verifier.score([ScoreRequest("ll", ids, len(ids))])[0].float()
    verifier.release("ll")
    rows = logits[len(ctx) - 1 : len(ids) - 1].log_softmax(-1)
    target = torch.tensor(cont)
    return float(rows.gather(-1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("models", nargs="+", help="served model name = the source it serves")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--task", default="s2d_mc_local")
    args = ap.parse_args()
    set_threads(1)
    dtype = getattr(torch, resolve_dtype(args.dtype))
    (args.out / "engine-ll").mkdir(parents=True, exist_ok=True)
    loaded: dict[str, object] = {}
    for pair in args.models:
        name, source = pair.split("=", 1)
        samples = max((args.out / "served" / name).rglob(f"samples_{args.task}_*.jsonl"))
        if source not in loaded:
            loaded[source] = load_model(source, dtype=dtype)
        model = loaded[source]
        verifier = TargetVerifier(model.model)
        with open(args.out / "engine-ll" / f"{name}.jsonl", "w") as f:
            for line in samples.read_text().splitlines():
                doc = json.loads(line)
                resps = []
                for arg in doc["arguments"].values():
                    ll, greedy = score(verifier, *encode_pair(model.tokenizer, arg["arg_0"], arg["arg_1"]))
                    resps.append([[str(ll), str(greedy)]])
                f.write(json.dumps({"doc_id": doc["doc_id"], "resps": resps}) + "\n")
        print(f"{name}: {samples.name} scored in-process ({source}, {dtype})")


if __name__ == "__main__":
    main()
