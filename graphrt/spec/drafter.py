"""Drafter: which running requests get drafts this step, and whether the step verifies at all.

A request drafts when it is decoding (its last token is its only uncomputed one) and has room
left under max_tokens and max_model_len; any sampling (greedy, random, top-k / top-p / min-p)
and any grammar may draft, because the verify step samples every position exactly as a main
step would and keeps drafts only while they equal those tokens.

Whether a step verifies is a cost model. A verify graph scores k + 1 positions for every row,
so a step with drafts costs ``ratio`` times a main step of the same rows (``StepTimes``: each
decode graph replayed at start-up, then whole steps as they run; 1.4 at one row and 1.3 at eight
for k = 1 on a 2-core CPU, `graphrt bench spec`). It yields ``rows + E`` tokens where E is the
expected number of accepted drafts, so it pays when ``E > rows · (ratio − 1)``.

A request's expected accepted drafts out of d are ``a + a² + … + aᵈ``, a its per-draft acceptance.
Drafts are accepted in order up to the first wrong one, so each verify step shows a request's
accepted drafts and at most one miss: ``a = accepted / (accepted + misses)``. The estimate is
optimistic on purpose — two accepted drafts are assumed before any is scored,
``a = (accepted + 2) / (accepted + misses + 2)`` — so a new request drafts (all k count) and
stops once its record says its drafts cannot pay: far below the break-even after its first miss
(MTP at one row, where a round costs nearly two main steps), near it after more rounds, each of
which loses little. One assumed draft was too few: a prompt-lookup request whose first proposal
missed stopped for good on a copying prompt that pays 1.7× (`graphrt bench spec`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from graphrt.spec.config import SpeculativeConfig
from graphrt.spec.ngram import NgramProposer

# rows → a verify step's time over a main step's at those rows (None: unknown, taken as 1)
CostRatio = Callable[[int], "float | None"]


class Drafter:
    assumed = 2  # accepted drafts assumed before any is scored

    def __init__(self, config: SpeculativeConfig, cost_ratio: CostRatio | None = None) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(self.k, config.prompt_lookup_max, config.prompt_lookup_min)
        self.cost_ratio = cost_ratio or (lambda rows: None)

    def acceptance(self, req) -> float:
        """The request's per-draft acceptance, optimistically."""
        accepted = req.num_accepted_tokens + self.assumed
        return accepted / (accepted + req.num_draft_misses)

    def expected_accepted(self, req, num_drafts: int) -> float:
        a = self.acceptance(req)
        return float(num_drafts) if a == 1.0 else a * (1 - a**num_drafts) / (1 - a)

    def propose(self, req, room: int) -> list[int]:
        """Up to ``room`` draft tokens for ``req`` (prompt lookup)."""
        return self.proposer.propose(np.asarray(req.all_token_ids, dtype=np.int64), room)

    def propose_for(self, running, tracked: dict, max_model_len: int) -> None:
        for req in running:
            req.draft_token_ids = []
        decoding = [req for req in running if req.num_tokens - req.num_computed_tokens == 1]
        candidates = [req for req in decoding if req.request_id in tracked]
        if not candidates:
            return
        ratio = self.cost_ratio(len(decoding))
        self.per_row_need = (1.0 if ratio is None else ratio) - 1.0
        needed = len(decoding) * self.per_row_need
        if sum(self.expected_accepted(req, self.k) for req in candidates) <= needed:
            self.declined(candidates)  # even k drafts a row would not pay: skip the lookups
            return
        expected = 0.0
        for req in candidates:
            room = min(
                self.k, req.params.max_tokens - len(req.output_token_ids) - 1, max_model_len - req.num_tokens - 1
            )
            if room >= 1:
                req.draft_token_ids = self.propose(req, room)
                expected += self.expected_accepted(req, len(req.draft_token_ids))
        if expected <= needed:
            self.declined([req for req in candidates if req.draft_token_ids])
            for req in candidates:
                req.draft_token_ids = []

    def declined(self, reqs) -> None:
        """The step decodes plainly: these requests' drafts (or, at best, k right drafts each)
        would not pay for a verify step."""


class MTPDrafter(Drafter):
    """Drafts from the model's MTP layer: the MTP step after each step leaves every drafting row's
    K drafts here (``remember``); a row takes them when they were made for its current length.

    The MTP step costs a layer's forward over every token a step computes, so a request whose
    drafts do not pay leaves it: a request whose expected accepted drafts (k before any is scored:
    the most it could gain) fall below its share of the measured cost of drafting (verify + MTP
    steps over main steps, the cost model of the verify decision) no longer runs through the MTP
    layer (``wants_mtp``) and decodes plainly, at plain speed. So does every request of a step
    whose drafts together do not pay for verifying it (``declined``; a verify graph pays k + 1
    slots for every row, drafted or not): until the batch changes the next step would decline
    them too, and without verify steps their records never change, so the MTP layer would run
    for nothing. A request leaves for good: the MTP layer needs the main model's hidden state at
    every position, and those of the steps it skipped are gone.
    """

    def __init__(self, config: SpeculativeConfig, cost_ratio: CostRatio | None = None) -> None:
        self.k = config.num_speculative_tokens
        self.cost_ratio = cost_ratio or (lambda rows: None)
        self.per_row_need = 0.0  # the last step's drafting cost a decoding row, in main steps
        self.left: set[str] = set()  # requests that stopped drafting (their MTP cache has gaps since)
        self.drafts: dict[str, tuple] = {}  # request id → (its length then, drafts, their distributions)

    def wants_mtp(self, req) -> bool:
        if req.request_id in self.left:
            return False
        if math.isinf(self.per_row_need):  # plain steps not timed yet
            return True
        if self.expected_accepted(req, self.k) > self.per_row_need:  # k before any draft is scored
            return True
        self.left.add(req.request_id)
        return False

    def declined(self, reqs) -> None:
        if not math.isinf(self.per_row_need):  # (plain steps untimed: no decision made)
            self.left.update(req.request_id for req in reqs)

    def remember(self, request_id: str, num_tokens: int, drafts: list[int], probs=None) -> None:
        self.drafts[request_id] = (num_tokens, drafts, probs)

    def probs_of(self, request_id: str, drafts) -> object:
        """The distributions [K, V] the request's ``drafts`` were drawn from, when they are the
        MTP layer's (None: drafts from elsewhere, e.g. a test's, count as one-hot)."""
        made = self.drafts.get(request_id)
        if made is None or made[2] is None or list(made[1][: len(drafts)]) != list(drafts):
            return None
        return made[2]

    def forget(self, request_id: str, finished: bool = False) -> None:
        self.drafts.pop(request_id, None)
        if finished:
            self.left.discard(request_id)

    def propose(self, req, room: int) -> list[int]:
        made = self.drafts.get(req.request_id)
        if made is None or made[0] != req.num_tokens:
            return []
        return list(made[1][:room])
