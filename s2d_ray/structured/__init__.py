"""Structured output: grammars (JSON schema, regex, Lark, choices, tool calls) compiled with llguidance, and the
logits processor that masks every scored position to what the grammar allows next."""

from .grammars import GrammarSpec, compile_grammar
from .processor import GrammarProcessor
from .tool_calls import read_calls
from .tools import ToolSpec, parse_tool_call, tool_grammar

__all__ = ["GrammarProcessor", "GrammarSpec", "ToolSpec", "compile_grammar", "parse_tool_call", "read_calls",
           "tool_grammar"]
