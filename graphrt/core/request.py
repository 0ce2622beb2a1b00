"""A request as the scheduler sees it: token ids, progress and state. No torch here."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

from graphrt.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own seed (given, or drawn from the engine's seed)
    eos_token_ids: tuple[int, ...] = ()
    arrival: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step only
    num_draft_tokens: int = 0  # drafts scored so far
    num_accepted_tokens: int = 0  # drafts accepted so far
    num_draft_misses: int = 0  # verify steps that rejected one of its drafts
    lora_id: int = 0  # the LoRA adapter's lora_int_id (0: the base model)
    lora_slot: int = -1  # its adapter slot while the request runs
    mm_input: object = None  # images: multimodal.inputs.MultiModalInput (positions, embeddings, hashes)

    @property
    def prefix_salt(self):
        """What a cached block's hash starts from: KV blocks are shared within one adapter only."""
        return ("lora", self.lora_id) if self.lora_id else None

    @property
    def prefix_keys(self) -> list:
        """What the prefix cache hashes, block by block: the token ids, with each image
        placeholder replaced by (its image's content hash, its patch): a block holding part of an
        image is shared only with the same image there; the text before the image is shared."""
        if self.mm_input is None:
            return self.all_token_ids
        keys = list(self.all_token_ids)
        for position, key in self.mm_input.position_keys:
            keys[position] = key
        return keys

    @property
    def can_burst(self) -> bool:
        """Whether its decode steps may run as a burst: not with a grammar (its mask follows each
        token) or the likeliest alternatives of each token (computed from the step's hidden states)."""
        return not self.params.has_constraint and self.params.num_top_logprobs == 0

    @functools.cached_property
    def ending_token_ids(self) -> frozenset[int]:
        """The tokens that end it when sampled (its end-of-sequence ones unless ignore_eos): the
        engine's stop check and a decode burst's end both read it."""
        p = self.params
        return frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
