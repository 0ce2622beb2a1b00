"""SpecStats: drafts proposed and accepted over the engine's life."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    draft_tokens: int = 0  # drafts scored by verify steps
    accepted_tokens: int = 0
    verified_rows: int = 0  # request rows that carried drafts into a verify step

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            self.verified_rows += 1

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            # tokens a drafted row produced in its verify step (accepted drafts + one)
            "spec_mean_accepted_length": (1 + self.accepted_tokens / self.verified_rows if self.verified_rows else 0.0),
        }
