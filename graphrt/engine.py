"""The engine core: requests in, one scheduled step at a time, outputs back.

Start-up (``EngineStartup.start``, in ``engine_startup.py``) loads the model, settles the
settings, sizes and allocates the KV cache, builds the scheduler and runner and captures the
graphs; this file is what happens after: requests, steps, outputs.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphrt.core.request import Request
from graphrt.core.stop import Detokenizer, token_stop_reason
from graphrt.engine_startup import CaptureRecord, EngineStartup  # noqa: F401  (CaptureRecord: re-exported)
from graphrt.grammar import GrammarCompiler, RequestGrammar
from graphrt.lora.config import LoRAConfig
from graphrt.lora.request import LoRARequest
from graphrt.multimodal.inputs import prepare as prepare_images
from graphrt.multimodal.inputs import prompt_embeds_input
from graphrt.outputs import RequestOutput
from graphrt.runner.graph_cache import CaptureSizes
from graphrt.runner.kv_cache import (
    CacheConfig,
)
from graphrt.runner.token_logprobs import record_prompt_logprobs, sampled_top_logprobs
from graphrt.sampling_params import InvalidRequestError, SamplingParams
from graphrt.spec.config import SpeculativeConfig
from graphrt.spec.mtp import run_mtp


class EngineStepError(RuntimeError):
    """A step failed; the requests in it were ended with finish_reason='error'."""


@dataclass(frozen=True)
class EngineConfig:
    """What the engine was asked for. None means unset: taken from a shipped graph cache's
    recorded settings when there is one, else the default (serving_settings.DEFAULTS)."""

    model: Any = None
    dtype: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    seed: int = 0
    capture_sizes: CaptureSizes | None = None
    progress: bool = True
    compile: bool = True
    backend: str = "inductor"  # inner backend of compiled graphs: inductor, eager, torchair
    passes_disabled: tuple[str, ...] = ()
    grammar_backend: str = "in-graph"  # or "xgrammar-cpu": the reference host round trip
    # None: the per-user graph cache; a directory: a shipped (precompiled) one; False: none
    graph_cache: str | bool | None = None
    strict_graph_cache: bool = False  # refuse, rather than rebuild, an untrustworthy entry
    rebuild_graph_cache: bool = False  # build graphs a shipped cache lacks for the settings asked
    speculative_config: SpeculativeConfig | None = None  # drafts verified in the graphs (ngram)
    torchair_mode: str = "max-autotune"  # backend="torchair": one GE graph, or "reduce-overhead" (ACL graphs)
    lora: LoRAConfig | None = None  # LoRA adapters served (slots, largest rank); None: none
    # None: weights as stored (a Q4/Q8 GGUF stays quantized); "int8"/"int4": quantized at load;
    # "none": every weight in dtype
    quantization: str | None = None
    limit_mm_per_prompt: int = 4  # images a prompt may hold (vision-language models)
    enable_prompt_embeds: bool = False  # accept prompts given as embeddings
    huge_pages: bool = True  # weights and KV caches in 2 MiB pages (runner/huge_pages.py)


@dataclass
class _Tracked:
    request: Request
    detok: Detokenizer
    output: RequestOutput
    grammar: RequestGrammar | None = None
    no_token_allowed: bool = False
    prompt_logprobs: list | None = None  # per prompt position, filled as the prefill computes it
    top_logprobs: list | None = None  # per output token (logprobs=k, k > 0)


class LLMEngine(EngineStartup):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._tracked: dict[str, _Tracked] = {}
        self.num_compiles = 0
        self.activation_peak = 0  # bytes; measured by profile_run when the KV budget needs it
        self.page_warmer = None  # started with the KV caches when they sit in huge pages

    # --- requests ------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def tokenize(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Token ids of a prompt: text (through the chat template when ``chat``), a conversation
        (a list of {role, content} messages, always through the chat template) or token ids."""
        conversation = bool(prompt) and isinstance(prompt, list) and isinstance(prompt[0], dict)
        if isinstance(prompt, str) or conversation:
            if self.tokenizer is None:
                raise InvalidRequestError("this checkpoint has no tokenizer files: pass prompts as lists of token ids")
            if chat or conversation:
                try:
                    ids = self.tokenizer.apply_chat_template(prompt)
                except Exception as e:  # the template's own complaint (raise_exception) or a render error
                    raise InvalidRequestError(f"the chat template cannot render these messages: {e}") from None
            else:
                ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        self._check_prompt(ids)
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        vocab = self.loaded.config.vocab_size
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt token {i} is {t!r}: token ids must be ints in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                f"to generate (prompts must be shorter than max_model_len)"
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | dict | None = None,
        chat: bool = False,
        lora_request: LoRARequest | None = None,
        multi_modal_data: dict | None = None,
        mm_input=None,
    ) -> str:
        """Validate and queue one request; raises InvalidRequestError (and queues nothing).
        ``multi_modal_data``: ``{"image": image or [images]}`` for a vision-language model (or
        ``mm_input``, what ``prepare_images`` made of it, with ``prompt`` its expanded ids)."""
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams or a dict, got {type(params).__name__}")
        ids = self.tokenize(prompt, chat)
        mm = mm_input
        if mm is None and multi_modal_data is not None:
            ids, mm = self.prepare_images(ids, multi_modal_data)
        self.validate_params(params)
        lora_id = self.register_lora(lora_request)
        grammar = (
            RequestGrammar(self._compiled_grammar(params), self.loaded.config.vocab_size)
            if params.has_constraint
            else None
        )
        rid = str(next(self._ids))
        seed = params.seed if params.seed is not None else self._rng.randrange(1 << 62)
        req = Request(rid, ids, params, seed, self.loaded.eos_token_ids, lora_id=lora_id, mm_input=mm)
        stops = params.stop
        tracked = _Tracked(req, Detokenizer(self.tokenizer, stops), RequestOutput(rid, list(ids)), grammar)
        if params.prompt_logprobs is not None:
            tracked.prompt_logprobs = [None] * len(ids)
        if params.num_top_logprobs:
            tracked.top_logprobs = []
        self._tracked[rid] = tracked
        self.scheduler.add_request(req)
        return rid

    def prepare_images(self, ids: list[int], multi_modal_data) -> tuple[list[int], object]:
        """The prompt with its image placeholders expanded, and its images encoded (cached)."""
        ids, mm = prepare_images(self.loaded.encoder, ids, multi_modal_data, self.config.limit_mm_per_prompt)
        self._check_prompt(ids)  # the expanded prompt must still fit
        return ids, mm

    def prepare_embeds(self, ids: list[int], embeds) -> object:
        """A prompt's own embeddings [len(ids), hidden], replacing its token embeddings."""
        if getattr(self.loaded.model, "mm_mask", None) is None:
            raise InvalidRequestError("prompt_embeds needs an engine started with enable_prompt_embeds=True")
        return prompt_embeds_input(ids, embeds, self.loaded.config.hidden_size, self.dtype)

    def register_lora(self, lora_request: LoRARequest | None) -> int:
        """The adapter's id (0: none), its directory read and checked the first time it is named."""
        if lora_request is None:
            return 0
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a graphrt.LoRARequest, got {type(lora_request).__name__}")
        if self.lora is None:
            raise InvalidRequestError(
                f"lora_request {lora_request.lora_name!r}: LoRA is off; start the engine with enable_lora=True"
            )
        return self.lora.register(lora_request)

    def validate_params(self, params: SamplingParams) -> None:
        """Engine-level checks of params (the grammar hooks in here)."""
        vocab = self.loaded.config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this checkpoint has none")
        if params.has_constraint:
            self._compiled_grammar(params)  # an invalid grammar is rejected with xgrammar's message

    def _compiled_grammar(self, params: SamplingParams):
        if self.tokenizer is None:
            raise InvalidRequestError("structured output needs a tokenizer; this checkpoint has none")
        if self.grammar_compiler is None:
            self.grammar_compiler = GrammarCompiler(self.tokenizer.hf, self.loaded.config.vocab_size)
        return self.grammar_compiler.compile(params)

    def _fill_bitmask(self, req_ids: tuple[str, ...], samples, drafts=None, span: int = 1) -> np.ndarray | None:
        """Each constrained row that samples this step gets its matcher's mask; others allow all.
        In a verify step (``span`` = k + 1 rows of masks a request) a row with drafts gets the
        mask after each accepted prefix of its drafts (the matcher ends where it started)."""
        rows = [
            (r, self._tracked[rid])
            for r, rid in enumerate(req_ids)
            if samples[r] and self._tracked[rid].grammar is not None
        ]
        if not rows:
            return None
        words = -(-self.loaded.config.vocab_size // 32)
        mask = np.full((len(req_ids) * span, words), -1, dtype=np.int32)
        for r, tracked in rows:
            d = (drafts or {}).get(req_ids[r])
            if d:
                tracked.grammar.fill_for_draft(list(d), mask[r * span : r * span + len(d) + 1])
                tracked.no_token_allowed = not mask[r * span].any()
            else:
                tracked.no_token_allowed = not tracked.grammar.fill(mask[r * span])
        return mask

    def abort(self, request_id: str) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is not None and not tracked.request.finished:
            self._finish(tracked, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _verify_cost_ratio(self, rows: int) -> float:
        """A step with drafts over a plain step, measured at ``rows`` decoding rows: the verify
        step (and with MTP the MTP step after it, which runs only for drafting requests) over a
        main step. Compiled graphs are timed at start-up (``time_decode_graphs``); a key that
        has no time (eager steps) is timed as it runs: plain steps first (no drafts until they
        are: infinite), then steps with drafts (taken while untimed: ratio 1), so that neither
        cost is guessed. A main time older than ``StepTimes.stale`` steps counts as untimed too:
        while every step verifies, one in that many decodes plainly to measure the main step at
        the current context (``runner/step_times.py``). The MTP step after a verify step holds 1 to
        k + 1 tokens a row; until the k + 1 size is timed, the one-token size stands for it."""
        main, verify, mtp_after_verify = self.graphs.decode_keys(rows)
        step_times = self.runner.step_times
        times = step_times.seconds
        if main not in times or step_times.is_stale(main):
            return math.inf
        if verify not in times:
            return 1.0
        cost = times[verify]
        if self.mtp_module is not None:
            mtp = times.get(mtp_after_verify, times.get(self.graphs.key_for("mtp", rows, rows)))
            if mtp is None:
                return 1.0
            cost += mtp
        return cost / times[main]

    # --- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the outputs of the requests it advanced (and of any
        finished ones), each the request's whole output so far."""
        if self.proposer is not None:
            self.proposer.propose_for(self.scheduler.running, self._tracked, self.max_model_len)
        out = self.scheduler.schedule()
        if self.page_warmer is not None:
            self.page_warmer.nudge()  # the blocks just handed out may bring its frontier closer
        if out.is_empty:
            self.runner.update_states(out)  # the requests finished since the last step leave the runner
            return []
        try:
            result = self.runner.execute(out)
        except Exception as e:
            failed = [self._tracked[rid] for rid in out.num_scheduled_tokens if rid in self._tracked]
            for tracked in failed:
                self._finish(tracked, "error")
            raise EngineStepError(f"step failed, {len(failed)} request(s) ended with 'error': {e}") from e
        record_prompt_logprobs(self.loaded.model, self._tracked, out, result)
        tops = sampled_top_logprobs(self.loaded.model, self._tracked, out, result)
        changed = []
        for req in self.scheduler.after_step(out, result.num_rejected):
            tracked = self._tracked[req.request_id]
            drafted = len(out.draft_token_ids.get(req.request_id, ()))
            # (a burst's steps not run are rejected too, with no drafts)
            accepted = drafted - result.num_rejected.get(req.request_id, 0) if drafted else 0
            req.num_draft_tokens += drafted
            req.num_accepted_tokens += accepted
            req.num_draft_misses += accepted < drafted
            self.spec_stats.record(drafted, accepted)
            top = tops.get(req.request_id) or [None] * len(result.sampled[req.request_id])
            for token, logprob, alternatives in zip(
                result.sampled[req.request_id], result.logprobs[req.request_id], top
            ):
                if not self._append(tracked, token, logprob, alternatives):
                    break  # finished: the rest of an accepted run is dropped
            changed.append(tracked.output)
        if self.mtp_module is not None:
            run_mtp(self, out, result)
        return changed

    def _append(self, tracked: _Tracked, token: int, logprob: float, alternatives=None) -> bool:
        """One sampled token through the grammar and the stop checks, in order; False once the
        request has finished."""
        req = tracked.request
        if tracked.grammar is not None and (tracked.no_token_allowed or not tracked.grammar.accept(token)):
            self._finish(tracked, "grammar")  # the grammar allows nothing: emit nothing illegal
            return False
        req.output_token_ids.append(token)
        req.output_logprobs.append(logprob)
        if tracked.top_logprobs is not None:
            tracked.top_logprobs.append(alternatives)
        reason = token_stop_reason(req, token, self.max_model_len)
        if tracked.detok.update(req.output_token_ids) and reason is None:
            reason = "stop"
        if reason is None and tracked.grammar is not None and tracked.grammar.terminated:
            reason = "stop"
        self._sync_output(tracked)
        if reason is not None:
            self._finish(tracked, reason)
            return False
        return True

    def _sync_output(self, tracked: _Tracked) -> None:
        o, req = tracked.output, tracked.request
        o.token_ids = list(req.output_token_ids)
        o.num_draft_tokens, o.num_accepted_tokens = req.num_draft_tokens, req.num_accepted_tokens
        o.text = tracked.detok.text
        if req.params.logprobs:
            o.logprobs = list(req.output_logprobs)
        if tracked.prompt_logprobs is not None:
            o.prompt_logprobs = list(tracked.prompt_logprobs)
        if tracked.top_logprobs is not None:
            o.top_logprobs = list(tracked.top_logprobs)

    def _finish(self, tracked: _Tracked, reason: str) -> None:
        self.scheduler.finish(tracked.request, reason)
        tracked.detok.finish(tracked.request.output_token_ids)
        self._sync_output(tracked)
        tracked.output.finish_reason = reason

    def output(self, request_id: str) -> RequestOutput:
        return self._tracked[request_id].output

    def detokenizer(self, request_id: str) -> Detokenizer:
        return self._tracked[request_id].detok

    def release(self, request_id: str) -> None:
        """Forget a finished request's output."""
        self._tracked.pop(request_id, None)

    def stats(self) -> dict[str, int]:
        return {
            "compiles": self.num_compiles,
            "graph_hits": self.graphs.hits,
            "graph_misses": self.graphs.misses,
            "total_blocks": self.blocks.num_usable_blocks,
            "free_blocks": self.blocks.num_free_blocks,
            "prefix_cache_hits": self.blocks.prefix_cache_hits,
            "preemptions": self.scheduler.num_preemptions,
            **({"warmed_blocks": self.page_warmer.warmed} if self.page_warmer is not None else {}),
            "lora_slot_fills": self.lora.fills if self.lora is not None else 0,
            **self.spec_stats.as_dict(),
        }
