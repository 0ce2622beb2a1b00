"""The engine core: requests in, one scheduled step at a time, outputs back.

Start-up runs in one documented order (``start``): load the model, profile a worst-case step,
size and allocate the KV cache, build the scheduler and runner, capture the graphs.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from graphrt.artifacts.store import ArtifactStore
from graphrt.compiler.graph_builder import GraphBuilder, PendingGraph, model_key
from graphrt.core.block_manager import BlockManager
from graphrt.core.request import Request
from graphrt.core.scheduler import Scheduler, SchedulerConfig
from graphrt.core.stop import Detokenizer, token_stop_reason
from graphrt.grammar import GrammarCompiler, RequestGrammar
from graphrt.loader import LoadedModel, load_model, resolve_dtype
from graphrt.outputs import RequestOutput
from graphrt.passes import PassManager
from graphrt.runner.graph_cache import CaptureSizes, GraphCache
from graphrt.runner.graph_key import GraphKey
from graphrt.runner.kv_cache import (
    CacheConfig,
    KVCachePlan,
    allocate_kv_caches,
    bytes_per_block,
    plan_kv_cache,
)
from graphrt.runner.model_runner import ModelRunner
from graphrt.runner.profile_run import worst_case_step_memory
from graphrt.runner.step_module import StepModule, VerifyStepModule
from graphrt.sampling_params import InvalidRequestError, SamplingParams
from graphrt.serving_settings import (
    GraphCacheMismatchError,
    ServingSettings,
    adopt,
    differences,
    graphs_to_build,
    mismatch_message,
    model_identity,
)
from graphrt.spec.config import SpeculativeConfig
from graphrt.spec.drafter import Drafter
from graphrt.spec.stats import SpecStats
from graphrt.user_cache import default_graph_cache_dir, remembered
from graphrt.version import __version__

BUILD_WORKERS = max(1, min(4, os.cpu_count() or 1))  # graph packages built side by side


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


@dataclass(frozen=True)
class CaptureRecord:
    key: GraphKey
    how: str  # "compiled" or "loaded"
    seconds: float  # from the start of its capture until it was ready (builds overlap)


@dataclass
class _Tracked:
    request: Request
    detok: Detokenizer
    output: RequestOutput
    grammar: RequestGrammar | None = None
    no_token_allowed: bool = False


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._tracked: dict[str, _Tracked] = {}
        self.num_compiles = 0
        self.activation_peak = 0  # bytes; measured by profile_run when the KV budget needs it

    # --- start-up, in this order ---------------------------------------------------------------

    def start(self) -> LLMEngine:
        t0 = time.perf_counter()
        self.open_graph_cache()
        self.load()
        self.configure()
        t1 = time.perf_counter()
        if self.kv_budget() is None:  # only a budget that is a share of free memory needs the profile
            self.activation_peak = remembered("profiles", self.profile_key(), self.profile_run)
        self.initialize_kv_cache()
        t2 = time.perf_counter()
        self.capture_model()
        self.record_settings()
        self.startup_seconds = {"load": t1 - t0, "kv_cache": t2 - t1, "graphs": time.perf_counter() - t2}
        return self

    def open_graph_cache(self) -> None:
        """The graph store: the per-user cache by default, a shipped directory when given (its
        recorded settings are read here), none when graphs are not AOTInductor packages."""
        c = self.config
        self.shipped_dir = isinstance(c.graph_cache, (str, os.PathLike))
        uses_store = c.compile and c.backend == "inductor" and c.graph_cache is not False
        root = os.fspath(c.graph_cache) if self.shipped_dir else default_graph_cache_dir()
        self.store = ArtifactStore(root, c.strict_graph_cache) if uses_store else None
        recorded = self.store.settings() if self.store is not None and self.shipped_dir else None
        self.shipped = ServingSettings.from_dict(recorded) if recorded else None

    def load(self) -> None:
        self.dtype = resolve_dtype(adopt(self.config.dtype, self.shipped, "dtype"))
        self.loaded: LoadedModel = load_model(self.config.model, self.dtype)

    def configure(self) -> None:
        """Settle every setting (given, else shipped, else default), check them against a shipped
        graph cache, and build what depends on them: scheduler limits, step module, graph cache."""
        c, shipped, cfg = self.config, self.shipped, self.loaded.config
        limit = cfg.max_position_embeddings
        if c.max_model_len is not None:
            self.max_model_len = c.max_model_len
        elif shipped is not None and shipped.max_model_len <= limit:
            self.max_model_len = shipped.max_model_len
        else:
            self.max_model_len = min(limit, 2048)
        if self.max_model_len > limit or self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must lie in [2, {limit}] for this model")
        num_seqs = adopt(c.max_num_seqs, shipped, "max_num_seqs")
        num_tokens = adopt(c.max_num_batched_tokens, shipped, "max_num_batched_tokens")
        self.block_size = adopt(c.cache.block_size, shipped, "block_size")
        spec_k = c.speculative_config.num_speculative_tokens if c.speculative_config is not None else 0
        self.sched_config = SchedulerConfig(
            num_seqs, min(num_tokens, self.max_model_len), self.max_model_len, num_seqs * (spec_k + 1) if spec_k else 0
        )
        if c.capture_sizes is not None:
            sizes = c.capture_sizes
        elif shipped is not None and (num_seqs, num_tokens) == (shipped.max_num_seqs, shipped.max_num_batched_tokens):
            sizes = shipped.capture_sizes
        else:
            sizes = CaptureSizes.default(num_seqs, self.sched_config.max_num_batched_tokens)
        self.settings = ServingSettings(
            model_identity(cfg.to_dict()),
            str(self.dtype).removeprefix("torch."),
            self.block_size,
            num_seqs,
            num_tokens,
            self.max_model_len,
            sizes,
            None,
            tuple(sorted(c.passes_disabled)),
            c.grammar_backend,
            c.speculative_config.num_speculative_tokens if c.speculative_config is not None else 0,
        )
        self.max_blocks = -(-self.max_model_len // self.block_size)
        self.step_module = StepModule(self.loaded.model, self.block_size, c.grammar_backend)
        self.spec = c.speculative_config
        self.verify_module, self.proposer, self.spec_stats = None, None, SpecStats()
        if self.spec is not None:
            self.spec.check_budget(self.sched_config.max_num_batched_tokens)
            self.verify_module = VerifyStepModule(
                self.loaded.model, self.block_size, self.spec.num_speculative_tokens, c.grammar_backend
            )
            self.proposer = Drafter(self.spec, self._verify_cost_ratio)
        self.grammar_compiler: GrammarCompiler | None = None  # built on the first constrained request
        self.graphs = GraphCache(sizes, num_seqs, self.max_blocks, -(-cfg.vocab_size // 32), spec_k)
        if shipped is not None and not c.rebuild_graph_cache:
            self._check_shipped_settings()
        self.model_key = (
            model_key(cfg.to_dict(), self.dtype, self.step_module, self.block_size) if self.store is not None else None
        )

    def _check_shipped_settings(self) -> None:
        """A shipped cache never compiles silently because of a setting: name each one that would
        make graphs the cache lacks, with the number of graphs."""
        diffs = differences(self.settings, self.shipped)
        if not diffs:
            return
        missing = graphs_to_build(diffs, self.graphs.all_keys(), self.shipped)
        if missing:
            raise GraphCacheMismatchError(mismatch_message(self.store.root, diffs, missing))

    def record_settings(self) -> None:
        """A directory given as a graph cache keeps the settings it was filled with (first fill, or
        a knowing rebuild), so that later engines can adopt them."""
        if self.store is None or not self.shipped_dir or not self.config.compile:
            return
        if self.shipped is None or self.config.rebuild_graph_cache:
            settings = dataclasses.replace(self.settings, kv_num_blocks=self.kv_plan.num_blocks)
            self.store.record_settings(settings.to_dict())

    def kv_budget(self) -> int | None:
        """The KV cache's bytes when they are fixed: given, or the size a shipped cache was built
        with (its default); None means a share of free memory."""
        if self.config.cache.kv_cache_memory is not None:
            return self.config.cache.kv_cache_memory
        if self.shipped is not None and self.shipped.kv_num_blocks and self.shipped.block_size == self.block_size:
            return self.shipped.kv_num_blocks * bytes_per_block(self.loaded.config, self.block_size, self.dtype)
        return None

    def profile_key(self) -> dict:
        """What the worst-case step's memory depends on (measured once, then remembered)."""
        s = self.sched_config
        return {
            "model": self.settings.model,
            "dtype": self.settings.dtype,
            "tokens": s.max_num_batched_tokens,
            "seqs": s.max_num_seqs,
            "max_blocks": self.max_blocks,
            "grammar_backend": self.config.grammar_backend,
            "graphrt": __version__,
        }

    def profile_run(self) -> int:
        """The worst-case step's peak memory growth in bytes (``runner/profile_run.py``)."""
        self.activation_peak = worst_case_step_memory(
            self.step_module, self.graphs, self.sched_config, self.loaded.config, self.dtype, self.block_size
        )
        return self.activation_peak

    def initialize_kv_cache(self) -> KVCachePlan:
        cache = dataclasses.replace(self.config.cache, block_size=self.block_size, kv_cache_memory=self.kv_budget())
        self.kv_plan = plan_kv_cache(self.loaded.config, cache, self.dtype, self.max_model_len, self.activation_peak)
        self.kv_caches = allocate_kv_caches(self.loaded.config, self.kv_plan.num_blocks, self.block_size, self.dtype)
        self.blocks = BlockManager(self.kv_plan.num_blocks, self.block_size, self.config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.sched_config, self.blocks)
        self.runner = ModelRunner(
            self.step_module,
            self.kv_caches,
            self.graphs,
            self.sched_config.max_num_seqs,
            self.max_model_len,
            self.verify_module,
        )
        self.runner.bitmask_provider = self._fill_bitmask
        return self.kv_plan

    def capture_model(self) -> list[CaptureRecord]:
        """Compile the graph of every key, largest first. Eager mode: nothing to capture."""
        self.capture_report: list[CaptureRecord] = []
        self.passes = PassManager(self.config.backend, self.config.passes_disabled)
        if not self.config.compile:
            return self.capture_report
        self.graphs.compiling = True
        steps = {"main": self.step_module, "verify": self.verify_module}
        builder = GraphBuilder(steps, self.kv_caches, self.passes, self.config.backend, self.store, self.model_key)
        keys = self.graphs.all_keys()
        bar = tqdm(total=len(keys), desc="capture", unit="graph", disable=not self.config.progress)
        pending: collections.deque[PendingGraph] = collections.deque()
        for key in keys:  # packages to build go to worker processes, a few side by side
            out = builder.start(key, self.graphs.buffers(key))
            if isinstance(out, PendingGraph):
                pending.append(out)
                if len(pending) >= BUILD_WORKERS:
                    self._captured(*builder.finish(pending.popleft()), bar)
            else:
                self._captured(*out, bar)
        while pending:
            self._captured(*builder.finish(pending.popleft()), bar)
        bar.close()
        return self.capture_report

    def _captured(self, graph, how: str, seconds: float, bar) -> None:
        key = next(k for k in self.graphs.all_keys() if k.name == graph.name)
        self.graphs.graphs[key] = graph
        self.num_compiles += how == "compiled"
        self.capture_report.append(CaptureRecord(key, how, seconds))
        bar.update(1)

    # --- requests ------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def tokenize(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this checkpoint has no tokenizer files: pass prompts as lists of token ids")
            ids = self.tokenizer.apply_chat_template(prompt) if chat else self.tokenizer.encode(prompt)
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
        self, prompt: str | list[int], params: SamplingParams | dict | None = None, chat: bool = False
    ) -> str:
        """Validate and queue one request; raises InvalidRequestError (and queues nothing)."""
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams or a dict, got {type(params).__name__}")
        ids = self.tokenize(prompt, chat)
        self.validate_params(params)
        grammar = (
            RequestGrammar(self._compiled_grammar(params), self.loaded.config.vocab_size)
            if params.has_constraint
            else None
        )
        rid = str(next(self._ids))
        seed = params.seed if params.seed is not None else self._rng.randrange(1 << 62)
        req = Request(rid, ids, params, seed, self.loaded.eos_token_ids)
        stops = params.stop
        self._tracked[rid] = _Tracked(req, Detokenizer(self.tokenizer, stops), RequestOutput(rid, list(ids)), grammar)
        self.scheduler.add_request(req)
        return rid

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

    def _verify_cost_ratio(self, rows: int) -> float | None:
        main, verify = self.graphs.decode_keys(rows)
        return self.runner.step_times.ratio(verify, main)

    # --- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the outputs of the requests it advanced (and of any
        finished ones), each the request's whole output so far."""
        if self.proposer is not None:
            self.proposer.propose_for(self.scheduler.running, self._tracked, self.max_model_len)
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        try:
            result = self.runner.execute(out)
        except Exception as e:
            failed = [self._tracked[rid] for rid in out.num_scheduled_tokens if rid in self._tracked]
            for tracked in failed:
                self._finish(tracked, "error")
            raise EngineStepError(f"step failed, {len(failed)} request(s) ended with 'error': {e}") from e
        changed = []
        for req in self.scheduler.after_step(out, result.num_rejected):
            tracked = self._tracked[req.request_id]
            drafted = len(out.draft_token_ids.get(req.request_id, ()))
            accepted = drafted - result.num_rejected.get(req.request_id, 0)
            req.num_draft_tokens += drafted
            req.num_accepted_tokens += accepted
            self.spec_stats.record(drafted, accepted)
            for token, logprob in zip(result.sampled[req.request_id], result.logprobs[req.request_id]):
                if not self._append(tracked, token, logprob):
                    break  # finished: the rest of an accepted run is dropped
            changed.append(tracked.output)
        return changed

    def _append(self, tracked: _Tracked, token: int, logprob: float) -> bool:
        """One sampled token through the grammar and the stop checks, in order; False once the
        request has finished."""
        req = tracked.request
        if tracked.grammar is not None and (tracked.no_token_allowed or not tracked.grammar.accept(token)):
            self._finish(tracked, "grammar")  # the grammar allows nothing: emit nothing illegal
            return False
        req.output_token_ids.append(token)
        req.output_logprobs.append(logprob)
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

    def _finish(self, tracked: _Tracked, reason: str) -> None:
        self.scheduler.finish(tracked.request, reason)
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
            **self.spec_stats.as_dict(),
        }
