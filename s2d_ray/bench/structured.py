"""`s2d bench structured`: JSON extraction under a JSON schema, speculative (S2D) against plain decoding with the same
grammar: tokens per second, mean accepted tokens (MAT), and whether each output parses, validates and equals plain.

Forced tokens (keys, quotes, separators) are what a grammar makes predictable; the draft and prompt lookup guess them,
so speculation should gain more here than on free text. Prompts run one at a time (batch 1) after an untimed warm-up.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "email": {"type": ["string", "null"]}}, "required": ["name", "age", "city", "email"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "customer": {"type": "string"}, "items": {"type": "array", "items": {"type": "object", "properties": {
        "product": {"type": "string"}, "quantity": {"type": "integer"}}, "required": ["product", "quantity"],
        "additionalProperties": False}}, "total": {"type": "number"}},
    "required": ["customer", "items", "total"], "additionalProperties": False}

BUILT_IN = [
    ("Maria Lopez, 34, lives in Madrid and can be reached at maria.lopez@example.com.", PERSON),
    ("Our new colleague is Tom Becker. He is 41 years old and moved here from Hamburg. No email yet.", PERSON),
    ("Dr. Aiko Tanaka (age 52) from Osaka; contact: a.tanaka@uni.example.jp", PERSON),
    ("Contact card: Samuel Okafor, Lagos, born 1990 so 35 now, sam.okafor@example.org", PERSON),
    ("Order from Jane Doe: 2 notebooks, 3 pens and 1 stapler, 17.50 dollars in total.", ORDER),
    ("Invoice for ACME Corp: 10 chairs and 2 desks. Total due: 1450.", ORDER),
    ("Peter Smith bought one laptop and two mice; he paid 1220.99.", ORDER),
    ("Customer Li Wei ordered 5 kg of rice, 2 bottles of soy sauce; total 23.", ORDER),
]


def register(bench) -> None:
    from ..commands.engine_args import add_engine_args

    p = bench.add_parser("structured", help="JSON extraction with a JSON schema: S2D vs plain with the same grammar")
    add_engine_args(p, mode=False)
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSONL with `text` and `schema` fields (default: the built-in extraction prompts)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def load_prompts(path: Path | None, limit: int | None) -> list[tuple[str, dict]]:
    rows = BUILT_IN
    if path is not None:
        rows = [(r["text"], r["schema"]) for r in map(json.loads, filter(str.strip, path.read_text().splitlines()))]
    return rows[:limit] if limit else rows


def run(args: argparse.Namespace) -> int:
    from ..build import build_engine
    from ..commands.engine_args import engine_config
    from ..prompts import encode_messages

    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    prompts = load_prompts(args.prompts, args.limit)
    results, outputs = {}, {}
    target = None
    for method, mode in (("plain", "ar"), ("s2d", "s2d")):
        built = build_engine(engine_config(args, mode=mode), target=target)
        target, tok = built.target, built.target.tokenizer
        encoded = [encode_messages(tok, [{"role": "user", "content": "Extract the data as JSON matching this schema: "
                                          f"{json.dumps(schema)}\n\nText: {text}"}]) for text, schema in prompts]
        decode(built.engine, tok, encoded[:1], [prompts[0][1]], 16)  # warm-up, untimed
        start = time.perf_counter()
        res = decode(built.engine, tok, encoded, [s for _, s in prompts], args.max_new_tokens)
        seconds = time.perf_counter() - start
        outputs[method] = [r.token_ids for r in res]
        results[method] = summary(res, tok, prompts, seconds)
    same = sum(a == b for a, b in zip(outputs["plain"], outputs["s2d"]))
    report = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "target": args.target,
              "draft": args.draft, "methods": results, "equal_outputs": same,
              "speedup": results["s2d"]["tokens_per_second"] / max(results["plain"]["tokens_per_second"], 1e-9)}
    print("| method | tok/s | MAT | valid | tokens |\n|---|---|---|---|---|")
    for name, r in results.items():
        cut = sum(row["finish_reason"] == "length" for row in r["per_prompt"])
        print(f"| {name} | {r['tokens_per_second']:.1f} | {r['mean_accepted']:.2f} | {r['valid']}/{len(prompts)} "
              f"({cut} cut at max-new-tokens) | {r['tokens']} |")
    print(f"S2D / plain: {report['speedup']:.2f}x; outputs equal: {same}/{len(prompts)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


def decode(engine, tok, encoded: list[list[int]], schemas: list[dict], max_new_tokens: int) -> list:
    """One prompt at a time, each with its own grammar processor."""
    from ..core.engine import GenerationRequest
    from ..structured import GrammarProcessor, GrammarSpec, compile_grammar

    out = []
    for i, (ids, schema) in enumerate(zip(encoded, schemas)):
        grammar = compile_grammar(GrammarSpec.json_schema(schema), tok)
        eos = (tok.eos_token_id,)
        req = GenerationRequest(f"s{i}", ids, max_new_tokens, stop_token_ids=eos,
                                processors=(GrammarProcessor(grammar, len(ids), eos),))
        out.extend(engine.generate([req]))
    return out


def summary(results: list, tok, prompts: list[tuple[str, dict]], seconds: float) -> dict:
    import jsonschema

    valid, rows = 0, []
    for res, (_, schema) in zip(results, prompts):
        ok = True
        try:
            jsonschema.validate(json.loads(tok.decode(res.token_ids, skip_special_tokens=True)), schema)
        except (ValueError, jsonschema.ValidationError):
            ok = False  # only an output cut by max_new_tokens can fail: the grammar admits nothing else
        valid += ok
        rows.append({"tokens": len(res.token_ids), "finish_reason": res.finish_reason, "valid": ok})
    tokens = sum(len(r.token_ids) for r in results)
    drafted = [r.metrics["mean_acceptance_length"] for r in results]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds, "valid": valid,
            "mean_accepted": sum(drafted) / len(drafted), "per_prompt": rows}
