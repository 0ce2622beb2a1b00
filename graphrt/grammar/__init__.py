"""Structured output through xgrammar: grammars compiled once, one matcher per request."""

from graphrt.grammar.compiler import GrammarCompiler
from graphrt.grammar.matcher import RequestGrammar

__all__ = ["GrammarCompiler", "RequestGrammar"]
