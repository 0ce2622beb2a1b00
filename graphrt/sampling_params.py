"""SamplingParams: how one request draws its tokens and when it stops (vLLM's names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class InvalidRequestError(ValueError):
    """A request cannot be served as submitted; the message says which value and what is allowed."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool | int = False  # True or k: each sampled token's log-probability (+ the k likeliest)
    prompt_logprobs: int | None = None  # each prompt token's log-probability (+ the top k), as vLLM
    # structured output (at most one)
    json_schema: Any = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    _fields_set: frozenset = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        # Normalise sequences so that params are hashable and lists are accepted.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name}={getattr(self, name)!r} is invalid: {allowed}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "it must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "it must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "it must be an integer >= 0 (0 or -1 means off)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "it must lie in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "it must lie in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", "it must be a non-negative integer or None")
        if not isinstance(self.logprobs, (bool, int)) or self.logprobs is not True and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "it must be a bool or an integer in [0, 20] (the top alternatives kept a token)")
        if self.num_top_logprobs and self.has_constraint:
            raise InvalidRequestError(
                f"logprobs={self.logprobs} (top alternatives) cannot be combined with structured output: "
                "ask for logprobs=True, or drop the constraint"
            )
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "it must be None or an integer in [0, 20] (the top alternatives kept)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "each stop string must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "each must be a non-negative integer")
        constraints = [n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None]
        if self.json_object:
            constraints.append("json_object")
        if len(constraints) > 1:
            raise InvalidRequestError(f"at most one structured-output constraint per request, got {constraints}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise bad("choice", "it must be a non-empty list of non-empty strings")

    @property
    def num_top_logprobs(self) -> int:
        """k of ``logprobs=k``: the likeliest tokens returned beside each sampled one (0 for a bool)."""
        return 0 if isinstance(self.logprobs, bool) else int(self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_constraint(self) -> bool:
        return self.json_object or any(
            getattr(self, n) is not None for n in ("json_schema", "regex", "grammar", "choice")
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        names = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s) {unknown}; known: {names}")
        return cls(**values)
