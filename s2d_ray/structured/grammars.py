"""What a request constrains its output to (`GrammarSpec`), compiled once per (grammar, tokenizer) with llguidance.

llguidance (rather than xgrammar) because it computes masks lazily from a token trie (no per-grammar precompute, so a
new schema costs about a millisecond), rolls back consumed tokens (a tree's branches share one matcher) and has no
heavy dependencies. JSON is compact-separated (`", "`, `": "`, no other whitespace between tokens): a small model can
otherwise loop on whitespace inside an object until max_tokens.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.hf

from ..errors import RequestError

GrammarKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept per process (a schema a client sends again compiles once)
MAX_SCHEMA_CHARS = 100_000


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint, hashable (the compile cache's key): `source` is the schema as JSON (key order kept: it is the
    order the properties are generated in), the regex, the Lark grammar, or the choices as a JSON list; `param` names
    the request field that gave it (for 400s)."""

    kind: GrammarKind
    source: str = ""
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> "GrammarSpec":
        check_json_schema(schema, param)
        return cls("json_schema", json.dumps(schema), param)

    def lark(self) -> str:
        """The grammar in llguidance's own format."""
        M = llguidance.LLMatcher
        if self.kind == "json_schema":
            return M.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)
        if self.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return M.grammar_from_regex(self.source)
        if self.kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.source)))
        return M.grammar_from_lark(self.source)


def check_json_schema(schema: Any, param: str) -> None:
    """A schema must be a JSON object that is a valid JSON Schema (draft 2020-12 rules where it names none)."""
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: the schema must be a JSON object", param)
    source = json.dumps(schema)
    if len(source) > MAX_SCHEMA_CHARS:
        raise RequestError(f"{param}: the schema is longer than {MAX_SCHEMA_CHARS} characters", param)
    # The check is pure Python (~15 ms even for a small tool's schema): a client sending the same tools each turn
    # pays it once per process for schemas up to CHECKED_CACHE_CHARS.
    error = _schema_error(source) if len(source) <= CHECKED_CACHE_CHARS else _schema_error.__wrapped__(source)
    if error is not None:
        raise RequestError(f"{param}: invalid JSON schema: {error}", param)


CHECKED_CACHE_CHARS = 8192  # schemas up to this long keep their check's verdict (at most 256 of them)


@functools.lru_cache(maxsize=256)
def _schema_error(source: str) -> str | None:
    """Why the schema (as JSON) is not a valid JSON Schema, or None."""
    import jsonschema

    try:
        schema = json.loads(source)
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except (jsonschema.SchemaError, RecursionError) as exc:
        return str(getattr(exc, "message", exc))
    return None


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar for one tokenizer: `matcher()` gives a fresh matcher at its start."""

    template: llguidance.LLMatcher
    tokenizer: llguidance.LLTokenizer

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


_lock = threading.Lock()
_tokenizers: dict[int, tuple[object, llguidance.LLTokenizer]] = {}  # id(hf tokenizer) -> (it, kept alive; its wrap)
_compiled: OrderedDict[tuple[int, GrammarSpec], CompiledGrammar] = OrderedDict()


def ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (built once per tokenizer: it indexes the vocabulary)."""
    with _lock:
        entry = _tokenizers.get(id(tokenizer))
    if entry is None:
        entry = (tokenizer, llguidance.hf.from_tokenizer(tokenizer))
        with _lock:
            _tokenizers[id(tokenizer)] = entry
    return entry[1]


def compile_grammar(spec: GrammarSpec, tokenizer) -> CompiledGrammar:
    """The spec compiled for `tokenizer`, cached; an invalid grammar is a RequestError naming `spec.param`."""
    key = (id(tokenizer), spec)
    with _lock:
        hit = _compiled.get(key)
        if hit is not None:
            _compiled.move_to_end(key)
            return hit
    lltok = ll_tokenizer(tokenizer)
    try:
        grammar = spec.lark()
    except Exception as exc:  # the library's own errors for a grammar it cannot read: the client's input
        raise RequestError(f"{spec.param}: {exc}", spec.param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
    if error and not error.startswith("WARNING"):
        raise RequestError(f"{spec.param}: invalid {spec.kind.replace('_', ' ')}: {error.strip()}", spec.param)
    template = llguidance.LLMatcher(lltok, grammar, log_level=0)
    if template.is_error():
        raise RequestError(f"{spec.param}: invalid {spec.kind.replace('_', ' ')}: {template.get_error()}", spec.param)
    compiled = CompiledGrammar(template, lltok)
    with _lock:
        _compiled[key] = compiled
        while len(_compiled) > CACHE_SIZE:
            _compiled.popitem(last=False)
    return compiled
