"""What the engine hands back to users."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort", "error", "grammar"
    logprobs: list[float] | None = None
    # with SamplingParams(logprobs=k), k > 0: per generated token, {token id: log-probability} of
    # the sampled token and the k likeliest at its position (before temperature and filters)
    top_logprobs: list[dict[int, float]] | None = None
    # with SamplingParams(prompt_logprobs=k): per prompt token, {token id: log-probability} holding
    # that token and the k most likely ones at its position; None for the first token
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts scored for this request
    num_accepted_tokens: int = 0  # ... and accepted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StreamEvent:
    index: int  # position of the prompt in the generate call
    request_id: str
    text: str  # new text since the last event of this request
    token_ids: tuple[int, ...]  # new tokens since the last event
    finish_reason: str | None
