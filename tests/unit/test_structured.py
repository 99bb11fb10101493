"""Structured output: the grammar processor masks each row along its own branch (equal to a fresh matcher advanced
over committed + branch, on SmolLM2's real tokenizer), and constrained greedy decoding is the same plain, with chains
and with trees (+ lookup) on a tiny float64 model whose vocabulary is a real byte-level tokenizer; the output parses
and validates. Negative controls: a processor that masks every row with the committed tokens' mask (the wrong
history), or that does not roll a rejected sibling back, is caught. Bad grammars are RequestErrors naming their field."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from core_fixtures import KERNELS, noisy_draft, tiny_target
from helpers import make_tiny_tokenizer
from s2d_ray.core.budget import SpeculationBudget, TreeShape
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.lookup import PromptLookup, TreeDrafter
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.errors import RequestError
from s2d_ray.structured import GrammarProcessor, GrammarSpec, ToolSpec, compile_grammar, parse_tool_call, tool_grammar
from s2d_ray.structured.tool_calls import read_calls

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}
TEXT = '{"name": "Ann", "age": 31, "ok": true}'


@pytest.fixture(scope="module")
def smol_tok():
    from s2d_ray.serve.loaders import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct", None, False)


@pytest.fixture(scope="module")
def tiny_tok():
    return make_tiny_tokenizer(320)


def fresh_mask(grammar, tokens: list[int], vocab: int, stop_ids: list[int]) -> torch.Tensor:
    """The reference: a new matcher advanced over `tokens`, one row's mask."""
    proc = GrammarProcessor(grammar, 0, stop_ids)
    return torch.isfinite(proc(tokens, [[]], torch.zeros(1, vocab)))[0]


def accepts(grammar, tokens: list[int]) -> bool:
    matcher = grammar.matcher()
    return matcher.try_consume_tokens(tokens) == len(tokens)


def test_masks_along_branches_equal_a_fresh_matcher(smol_tok):
    grammar = compile_grammar(GrammarSpec.json_schema(SCHEMA), smol_tok)
    ids = smol_tok.encode(TEXT)
    prompt = [1, 5, 9]
    proc = GrammarProcessor(grammar, len(prompt), [2])
    vocab = len(smol_tok)
    for cut in (0, 3, 7):  # committed grows between calls (the matcher advances lazily)
        committed = prompt + ids[:cut]
        rest = ids[cut:]
        # a chain's prefixes, a sibling branch the grammar rejects (after its first token), a branch it rejects at
        # once, then siblings after those rejections: each valid row equals a fresh matcher's mask
        x, close = smol_tok.encode("x")[0], smol_tok.encode("}")[0]
        branches = [rest[:j] for j in range(4)] + [rest[:1] + [x], [close], rest[:2], rest[:1], rest[:3]]
        out = proc(committed, branches, torch.zeros(len(branches), vocab))
        assert not accepts(grammar, ids[:cut] + branches[5])  # `}` is never right after these prefixes
        for row, branch in enumerate(branches):
            if not accepts(grammar, ids[:cut] + branch):
                assert torch.isfinite(out[row]).nonzero().flatten().tolist() == [2], (cut, row)  # rejected: stops
                continue
            expected = fresh_mask(grammar, ids[:cut] + branch, vocab, [2])
            assert torch.equal(torch.isfinite(out[row]), expected), (cut, row)
    full = proc(prompt + ids, [[]], torch.zeros(1, vocab))
    assert torch.isfinite(full[0]).nonzero().flatten().tolist() == [2]  # complete: only the stop token


def test_negative_control_masks_without_the_branch_differ(smol_tok):
    grammar = compile_grammar(GrammarSpec.json_schema(SCHEMA), smol_tok)
    ids = smol_tok.encode(TEXT)
    proc = GrammarProcessor(grammar, 0, [2])
    out = proc(ids[:2], [[], ids[2:4]], torch.zeros(2, len(smol_tok)))
    wrong = proc(ids[:2], [[], []], torch.zeros(2, len(smol_tok)))  # row 1 with the committed tokens' history
    assert not torch.equal(torch.isfinite(out[1]), torch.isfinite(wrong[1]))


class NoRollback(GrammarProcessor):
    """Wrong rule: a sibling's branch is consumed on top of the previous one's (no rollback between rows)."""

    def _rollback(self, n, kept):
        pass


def test_negative_control_rows_after_a_rejected_sibling_need_the_rollback(smol_tok):
    grammar = compile_grammar(GrammarSpec.json_schema(SCHEMA), smol_tok)
    ids = smol_tok.encode(TEXT)
    branches = [ids[:2], ids[:1] + smol_tok.encode("x")[:1], ids[:2]]  # the last row comes after a rejected sibling
    out = NoRollback(grammar, 0, [2])([], branches, torch.zeros(3, len(smol_tok)))
    assert not torch.equal(torch.isfinite(out[2]), fresh_mask(grammar, ids[:2], len(smol_tok), [2]))


class RootMaskOnly(GrammarProcessor):
    """Wrong rule: every row masked as if it followed the committed tokens (its branch ignored)."""

    def __call__(self, committed, branches, logits):
        return super().__call__(committed, [[]] * len(branches), logits)


def engines(target):
    draft = noisy_draft(target)
    tree = SpeculationBudget(TreeShape(width=3, lookup=True, max_nodes=12), None, max_depth=6)
    return {
        "plain": SpecEngine(TargetVerifier(target, kernels=KERNELS)),
        "chain": SpecEngine(TargetVerifier(target, kernels=KERNELS), SortedDrafter(draft), FixedK(4)),
        "tree": SpecEngine(TargetVerifier(target, kernels=KERNELS),
                           TreeDrafter(SortedDrafter(draft), PromptLookup(3, 4), alone_ngram=3), FixedK(3),
                           budget=tree),
    }


def constrained(engine, tok, prompts, grammar, kind=GrammarProcessor, n=48):
    reqs = [GenerationRequest(f"g{i}", p, n, stop_token_ids=(tok.eos_token_id,),
                              processors=(kind(grammar, len(p), [tok.eos_token_id]),)) for i, p in enumerate(prompts)]
    return engine.generate(reqs)


def test_constrained_greedy_is_the_same_plain_chain_and_tree(tiny_tok):
    target = tiny_target(seed=0, vocab_size=len(tiny_tok))
    grammar = compile_grammar(GrammarSpec.json_schema(SCHEMA), tiny_tok)
    prompts = [tiny_tok.encode(p) for p in ("The quick brown fox", "def add(a, b):", "Natalia sold 48 clips")]
    runs = {name: constrained(e, tiny_tok, prompts, grammar) for name, e in engines(target).items()}
    plain = [r.token_ids for r in runs["plain"]]
    for name in ("chain", "tree"):
        assert [r.token_ids for r in runs[name]] == plain, name
    drafted = sum(r.metrics["num_draft_tokens"] for name in ("chain", "tree") for r in runs[name])
    assert drafted > 0
    for res in runs["plain"]:
        assert res.finish_reason == "stop"
        jsonschema.validate(json.loads(tiny_tok.decode(res.token_ids, skip_special_tokens=True)), SCHEMA)
    # Negative control: the branch-blind mask lets trees emit what plain decoding with that rule would not.
    wrong = constrained(engines(target)["tree"], tiny_tok, prompts, grammar, RootMaskOnly)
    assert [r.token_ids for r in wrong] != plain


SMALL_TOOLS = (ToolSpec.of("f", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["a"]}, None),
               ToolSpec.of("g", {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}, None))


@pytest.mark.parametrize("choice,min_tokens", [("f", 20), ("required", 45)])
def test_several_tool_calls_greedy_is_the_same_plain_chain_and_tree(tiny_tok, choice, min_tokens):
    """The grammar of several calls (one per line) is a logits processor like any: chains and trees (+ lookup) give
    plain decoding's output token for token. min_tokens holds EOS back past the first call, so the output goes on
    to a second call where the grammar allows one; without parallel calls it allows none and the output ends after
    one (the grammar's control), and the branch-blind mask changes the output (the processor's control)."""
    from s2d_ray.core.penalties import PenaltySpec, penalty_processors

    target = tiny_target(seed=0, vocab_size=len(tiny_tok))
    prompts = [tiny_tok.encode(p) for p in ("The quick brown fox", "def add(a, b):", "Natalia sold 48 clips")]
    eos = tiny_tok.eos_token_id

    def run(engine, grammar, kind=GrammarProcessor):
        reqs = [GenerationRequest(f"g{i}", p, 64, stop_token_ids=(eos,), processors=(
            *penalty_processors(PenaltySpec(min_tokens=min_tokens), len(p), (eos,)), kind(grammar, len(p), [eos])))
            for i, p in enumerate(prompts)]
        return engine.generate(reqs)

    for parallel in (True, False):
        grammar = compile_grammar(tool_grammar(SMALL_TOOLS, choice, parallel), tiny_tok)
        runs = {name: run(e, grammar) for name, e in engines(target).items()}
        plain = [r.token_ids for r in runs["plain"]]
        for name in ("chain", "tree"):
            assert [r.token_ids for r in runs[name]] == plain, (name, parallel)
        assert sum(r.metrics["num_draft_tokens"] for name in ("chain", "tree") for r in runs[name]) > 0
        for res in runs["plain"]:
            calls = read_calls(tiny_tok.decode(res.token_ids, skip_special_tokens=True), choice).calls
            assert len(calls) >= 2 if parallel else len(calls) == 1, (parallel, calls)
            assert json.loads(calls[0][1]) and {name for name, _ in calls} <= {"f", "g"}  # a later one may be cut
        if parallel:
            wrong = run(engines(target)["tree"], grammar, RootMaskOnly)
            assert [r.token_ids for r in wrong] != plain


def test_a_grammar_that_cannot_end_stops_at_length(tiny_tok):
    target = tiny_target(seed=0, vocab_size=len(tiny_tok))
    grammar = compile_grammar(GrammarSpec("regex", "(ab){40}"), tiny_tok)  # 80 characters: more than 12 tokens
    (res,) = constrained(engines(target)["chain"], tiny_tok, [tiny_tok.encode("abc")], grammar, n=12)
    assert res.finish_reason == "length" and len(res.token_ids) == 12
    assert tiny_tok.decode(res.token_ids).startswith("abab")


@pytest.mark.parametrize("spec,param", [
    (lambda: GrammarSpec.json_schema({"type": "nonsense"}), "response_format"),
    (lambda: GrammarSpec.json_schema([1, 2], "structured_outputs"), "structured_outputs"),
    (lambda: GrammarSpec("regex", "a(b", "structured_outputs"), "structured_outputs"),
    (lambda: GrammarSpec("grammar", "start: ???", "structured_outputs"), "structured_outputs"),
])
def test_bad_grammars_name_their_field(tiny_tok, spec, param):
    with pytest.raises(RequestError) as err:
        compile_grammar(spec(), tiny_tok)
    assert err.value.param == param


def test_compiles_are_cached(tiny_tok):
    spec = GrammarSpec.json_schema(SCHEMA)
    assert compile_grammar(spec, tiny_tok) is compile_grammar(GrammarSpec.json_schema(SCHEMA), tiny_tok)


TOOLS = (ToolSpec.of("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                     "required": ["city"]}, "Weather"),
         ToolSpec.of("add", {"type": "object", "properties": {"a": {"type": "integer"}}}, None))
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL2 = '{"name": "add", "arguments": {"a": 2}}'
WRAP = "<tool_call>{}</tool_call>".format
# Per tool_choice: (one call, two calls, text, bad) and the two calls' (name, arguments).
TOOL_CASES = {"auto": (WRAP(CALL), WRAP(CALL) + "\n" + WRAP(CALL2), "Just text.", "<tool_call>Paris"),
              "required": (CALL, CALL + "\n" + CALL2, None, "Just text."),
              "get_weather": ('{"city": "Paris"}', '{"city": "Paris"}\n{"city": "Oslo"}', None, CALL)}
SECOND = {"auto": ("add", '{"a": 2}'), "required": ("add", '{"a": 2}'),
          "get_weather": ("get_weather", '{"city": "Oslo"}')}


def whole_match(grammar, tok, text: str) -> bool:
    ids = tok.encode(text)
    matcher = grammar.matcher()
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_grammars_accept_calls_and_parse_back(smol_tok, parallel):
    """One call (or text, with auto) always; two calls, one per line, only with parallel calls allowed (the control:
    the same two-call output is refused without); both read back with their names and arguments."""
    for choice, (one, two, text, bad) in TOOL_CASES.items():
        grammar = compile_grammar(tool_grammar(TOOLS, choice, parallel), smol_tok)
        for sample, accepted in ((one, True), (text, True), (bad, False), (two, parallel), (one + "\n", False)):
            if sample is not None:
                assert whole_match(grammar, smol_tok, sample) == accepted, (choice, parallel, sample)
        content, calls = parse_tool_call(one, choice)
        assert content is None and calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
        content, calls = parse_tool_call(two, choice)
        assert content is None and len(calls) == 2 and len({c["id"] for c in calls}) == 2
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_weather", '{"city": "Paris"}'), SECOND[choice]]
    assert parse_tool_call("Just text.", "auto") == ("Just text.", None)


def test_calls_read_from_every_prefix_only_grow(smol_tok):
    """Reading an output as it grows (a stream) never takes back what it read: each prefix's text and each call's
    name and arguments are prefixes of the whole output's reading, the wrapper's closing characters never leak into
    the arguments, and a call cut short keeps its partial arguments. Control: reading each prefix as if it were the
    whole output does take things back (where a wrapper follows the arguments)."""
    for choice, (_, two, text, _) in TOOL_CASES.items():
        for out in filter(None, (two, text)):
            whole = read_calls(out, choice)
            careless = False
            for cut in range(len(out) + 1):
                part = read_calls(out[:cut], choice, done=False)
                assert part.content is None or (whole.content or "").startswith(part.content), (choice, cut)
                assert len(part.calls) <= len(whole.calls)
                for (name, args), (whole_name, whole_args) in zip(part.calls, whole.calls):
                    assert name == whole_name and whole_args.startswith(args), (choice, cut, args)
                done = read_calls(out[:cut], choice, done=True)
                careless |= any(not w.startswith(a) for (_, a), (_, w) in zip(done.calls, whole.calls))
            assert careless == (choice != "get_weather" and out == two), choice  # a named call has no wrapper
    cut = read_calls(WRAP(CALL)[:WRAP(CALL).index("ris")], "auto")  # finish_reason length inside the arguments
    assert cut.calls == [("get_weather", '{"city": "Pa')] and cut.content is None


def test_cli_json_schema_and_penalty_flags(tiny_llama_dir, tmp_path, capsys):
    from s2d_ray.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    base = ["generate", "--target", str(tiny_llama_dir), "--draft", f"cut:{tiny_llama_dir}:2", "--prompt", "Person:",
            "--max-new-tokens", "48", "--json", "--dtype", "float32"]
    outs = {}
    for mode in ("ar", "s2d"):
        assert main([*base, "--mode", mode, "--json-schema", str(schema), "--frequency-penalty", "0.5"]) == 0
        (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        jsonschema.validate(json.loads(row["text"]), SCHEMA)
        outs[mode] = row["token_ids"]
    assert outs["ar"] == outs["s2d"]
    assert main([*base, "--frequency-penalty", "3"]) == 2
    assert "--frequency-penalty" in capsys.readouterr().err
    schema.write_text('{"type": "nonsense"}')
    assert main([*base, "--json-schema", str(schema)]) == 2
    assert "--json-schema" in capsys.readouterr().err
