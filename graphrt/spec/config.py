"""SpeculativeConfig: vLLM's ``speculative_config`` keys, checked at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "mtp")
ALIASES = {"deepseek_mtp": "mtp"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config keys {unknown} are not known; keys: {sorted(known)}")
        if "method" not in d:
            raise ValueError(f"speculative_config needs 'method'; methods: {list(METHODS)}")
        return cls(**{**d, "method": ALIASES.get(d["method"], d["method"])})

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method={self.method!r} is not known; methods: {list(METHODS)} (aliases: {ALIASES})"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r} must be an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )

    def check_budget(self, max_num_batched_tokens: int) -> None:
        """A verify step schedules 1 + k tokens for one request: they must fit one step."""
        if 1 + self.num_speculative_tokens > max_num_batched_tokens:
            raise ValueError(
                f"speculative_config num_speculative_tokens={self.num_speculative_tokens} is too large: "
                f"1 + k tokens must fit max_num_batched_tokens={max_num_batched_tokens} "
                f"(allowed: 1..{max_num_batched_tokens - 1})"
            )
