"""Compile a request's constraint (JSON schema, any JSON, regex, EBNF grammar, choice) against the
model's tokenizer, once per distinct constraint."""

from __future__ import annotations

import json
from typing import Any

from graphrt.sampling_params import InvalidRequestError, SamplingParams


def constraint_of(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, canonical text) of a request's constraint, the compile cache's key."""
    if params.json_schema is not None:
        schema = params.json_schema
        # property order is part of a schema: xgrammar emits properties in the order given
        return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
    if params.json_object:
        return "json_object", ""
    if params.regex is not None:
        return "regex", params.regex
    if params.grammar is not None:
        return "grammar", params.grammar
    if params.choice is not None:
        return "choice", json.dumps(list(params.choice))
    return None


def choice_grammar(choices: list[str]) -> str:
    alternatives = " | ".join(json.dumps(c) for c in choices)  # JSON string escapes are EBNF's
    return f"root ::= {alternatives}"


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2)
        self.cache: dict[tuple[str, str], Any] = {}
        self.compiles = 0

    def compile(self, params: SamplingParams):
        """The compiled grammar of the request's constraint; InvalidRequestError with xgrammar's
        message when the constraint is invalid."""
        key = constraint_of(params)
        assert key is not None
        if key not in self.cache:
            kind, text = key
            try:
                if kind == "json_schema":
                    # compact JSON: no unbounded whitespace for a model to wander in
                    compiled = self.compiler.compile_json_schema(text, any_whitespace=False)
                elif kind == "json_object":
                    compiled = self.compiler.compile_builtin_json_grammar()
                elif kind == "regex":
                    compiled = self.compiler.compile_regex(text)
                elif kind == "grammar":
                    compiled = self.compiler.compile_grammar(text)
                else:
                    compiled = self.compiler.compile_grammar(choice_grammar(json.loads(text)))
            except Exception as e:  # xgrammar raises RuntimeError / ValueError with its reason
                raise InvalidRequestError(f"invalid {kind}: {e}") from None
            self.cache[key] = compiled
            self.compiles += 1
        return self.cache[key]
