"""GraphKey: the one thing compiled graphs are looked up by."""

from __future__ import annotations

from dataclasses import dataclass

STEP_KINDS = ("main", "verify", "mtp")


@dataclass(frozen=True, order=True)
class GraphKey:
    kind: str  # "main" (prefill/decode), "verify" (score drafts), "mtp" (draft steps)
    num_tokens: int
    num_reqs: int

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"kind {self.kind!r} is not a step kind; kinds: {STEP_KINDS}")
        if not 1 <= self.num_reqs <= self.num_tokens:
            raise ValueError(f"GraphKey needs 1 <= num_reqs <= num_tokens, got {self}")

    @property
    def name(self) -> str:
        return f"{self.kind}-t{self.num_tokens}-r{self.num_reqs}"
