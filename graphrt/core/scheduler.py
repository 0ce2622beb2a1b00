"""Continuous batching with chunked prefill, decode-first priority and preemption by recompute.
A step of decoding rows only, with no request waiting, may be a decode burst: several decode
steps run by the runner in turn, so that the host's per-step work is paid once for them.

Pure Python, no torch. Each ``schedule()`` fills one step under ``max_num_seqs`` and
``max_num_batched_tokens``: running requests first (decodes and prefill continuations, oldest
first), then waiting ones. When blocks run out, the newest running request is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed later (its tokens so
far are kept, so it finishes with the same tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from graphrt.core.block_manager import BlockManager
from graphrt.core.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int = 2048
    max_verify_tokens: int = 0  # the most tokens a step with drafts may hold (its verify graphs')

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # non-empty when a preempted request resumes
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    request: Request  # sampling params, seed


@dataclass(frozen=True)
class CachedRequestData:
    request_id: str
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    new_token_ids: tuple[int, ...]  # tokens sampled since the runner last saw the request


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: tuple[NewRequestData, ...]
    cached_requests: tuple[CachedRequestData, ...]
    num_scheduled_tokens: dict[str, int]  # in step order
    finished_request_ids: frozenset[str]  # finished, aborted or preempted since the last step
    draft_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)  # scheduled drafts
    # a decode burst: every row decodes this many tokens in turn, one graph replay each, within
    # one step (num_scheduled_tokens holds the burst's length a row)
    decode_steps: int = 1

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class _RunnerView:
    """What the runner already knows of a running request (to send only the changes)."""

    num_blocks: int
    num_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, adapters=None) -> None:
        self.config = config
        self.blocks = blocks
        self.adapters = adapters  # a LoRAManager when LoRA adapters are served
        # the longest decode burst (1: none); the engine sets it where its steps allow bursts
        self.decode_burst = 1
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._runner_view: dict[str, _RunnerView] = {}
        self._finished_since_step: set[str] = set()

    # --- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """Finish (or abort) a request: free its blocks, forget it."""
        if request.finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)
        self._drop_adapter(request)
        self.requests.pop(request.request_id, None)
        if self._runner_view.pop(request.request_id, None) is not None:
            self._finished_since_step.add(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        drafts: dict[str, tuple[int, ...]] = {}
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []

        # 1. Running requests, oldest first; preempt the newest when blocks run short.
        preemptions_before = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.blocks.allocate(req.request_id, req.num_computed_tokens + num_new) is None:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req itself was preempted: nothing after it can run either
            num_new += self._schedule_drafts(req, num_new, budget, drafts)
            scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        # 2. Waiting requests, in order, while there is room (not after a preemption: the room
        #    is not there, and the preempted request would thrash).
        preempted = self.num_preemptions != preemptions_before
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.lora_id and req.lora_slot < 0:
                slot = self.adapters.acquire(req.lora_id)
                if slot is None:
                    break  # every adapter slot is held by running requests of other adapters
                req.lora_slot = slot
            fresh = req.request_id not in self.blocks.tables
            if fresh:  # prompt log-probabilities need every prompt position computed: no cached prefix
                reuse = req.params.prompt_logprobs is None
                salt = req.prefix_salt
                req.num_computed_tokens = self.blocks.match_prefix(req.request_id, req.prefix_keys, reuse, salt)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.blocks.allocate(req.request_id, req.num_computed_tokens + num_new) is None:
                if fresh and not self.running:
                    raise RuntimeError(
                        f"request {req.request_id} needs more KV blocks than the cache holds "
                        f"({self.blocks.num_usable_blocks}); it should have been rejected at submission"
                    )
                self.blocks.free(req.request_id)  # give back any prefix blocks it took
                self._drop_adapter(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = num_new
            budget -= num_new

        # A step with drafts runs a verify graph, which holds at most max_verify_tokens tokens: a
        # bigger step (a long prefill chunk in it) leaves its drafts out (the blocks they reserved
        # stay with their requests and are used as those grow).
        if drafts and sum(scheduled.values()) > self.config.max_verify_tokens:
            for rid in drafts:
                scheduled[rid] = 1
            drafts = {}
        for req in self.running:
            req.draft_token_ids = []
        steps = self._decode_burst(scheduled) if not drafts and not self.waiting else 1

        # 3. Describe the step for the runner: full data for requests it has not seen, changes
        #    for the rest.
        for rid in scheduled:
            req = self.requests[rid]
            table = self.blocks.block_table(rid)
            view = self._runner_view.get(rid)
            if view is None:
                new_reqs.append(
                    NewRequestData(
                        rid,
                        tuple(req.prompt_token_ids),
                        tuple(req.output_token_ids),
                        tuple(table),
                        req.num_computed_tokens,
                        req,
                    )
                )
                self._runner_view[rid] = _RunnerView(len(table), req.num_tokens)
            else:
                cached.append(
                    CachedRequestData(
                        rid,
                        tuple(table[view.num_blocks :]),
                        req.num_computed_tokens,
                        tuple(req.all_token_ids[view.num_tokens :]),
                    )
                )
                view.num_blocks, view.num_tokens = len(table), req.num_tokens
        out = SchedulerOutput(
            tuple(new_reqs), tuple(cached), scheduled, frozenset(self._finished_since_step), drafts, steps
        )
        self._finished_since_step.clear()
        return out

    def _schedule_drafts(self, req: Request, num_new: int, budget: int, drafts: dict) -> int:
        """Schedule a decoding request's drafts after its last token when the budget and the free
        blocks allow (never by preempting); returns how many were scheduled."""
        if not req.draft_token_ids or num_new != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        d = tuple(req.draft_token_ids[: budget - num_new])
        if not d or self.blocks.allocate(req.request_id, req.num_computed_tokens + num_new + len(d)) is None:
            return 0
        drafts[req.request_id] = d
        return len(d)

    def _decode_burst(self, scheduled: dict[str, int]) -> int:
        """A step whose every row decodes (one token, its last) and may burst, with nobody waiting
        to be admitted between its tokens, runs as a burst of up to ``decode_burst`` decode steps:
        as long as every row can take (its max_tokens, max_model_len) and the free blocks hold,
        never by preempting. Returns the burst's length (1: a plain step); ``scheduled`` then
        holds it for every row."""
        steps = self.decode_burst
        if steps < 2 or not scheduled:
            return 1
        for rid, n in scheduled.items():
            req = self.requests[rid]
            if n != 1 or req.num_tokens - req.num_computed_tokens != 1 or not req.can_burst:
                return 1
            left = min(req.params.max_tokens - len(req.output_token_ids), self.config.max_model_len - req.num_tokens)
            steps = min(steps, left)
        if steps < 2:
            return 1
        for rid in scheduled:  # blocks taken for a burst that then fails stay with their requests
            req = self.requests[rid]
            if self.blocks.allocate(rid, req.num_computed_tokens + steps) is None:
                return 1
        for rid in scheduled:
            scheduled[rid] = steps
        return steps

    def _drop_adapter(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.adapters.release(req.lora_id)
            req.lora_slot = -1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id)
        self._drop_adapter(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        if self._runner_view.pop(req.request_id, None) is not None:
            self._finished_since_step.add(req.request_id)

    def after_step(self, out: SchedulerOutput, num_rejected: dict[str, int] | None = None) -> list[Request]:
        """Advance every scheduled request by its tokens, less its rejected drafts (their K/V is
        never read: it lies past the request's length and is overwritten) or the steps a burst
        did not run (it ended at a stop token); returns the requests whose prompt is done and so
        sampled this step. Only blocks full of known tokens are published to the prefix cache
        (accepted drafts, and a burst's tokens, join the next step's publication)."""
        sampled = []
        rejected = num_rejected or {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            req.num_computed_tokens += n - rejected.get(rid, 0)
            known = min(req.num_computed_tokens, req.num_tokens)
            self.blocks.cache_full_blocks(rid, req.prefix_keys, known)
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append(req)
        return sampled
