"""How an engine comes up, in one documented order (``start``): open the graph cache, load the
model, settle every setting (given, shipped or default) and build what depends on them, profile
a worst-case step when the KV budget is a share of free memory, size and allocate the KV cache,
build the scheduler and runner, capture (compile or load) the graphs, record the settings."""

from __future__ import annotations

import collections
import dataclasses
import os
import time
import weakref
from dataclasses import dataclass

from tqdm.auto import tqdm

from graphrt.artifacts.store import ArtifactStore
from graphrt.compiler.graph_builder import GraphBuilder, PendingGraph, model_key
from graphrt.core.block_manager import BlockManager
from graphrt.core.scheduler import Scheduler, SchedulerConfig
from graphrt.grammar import GrammarCompiler
from graphrt.kernels import NATIVE_ISA, NATIVE_PACKS_BF16, packed_bf16, quant_tiles
from graphrt.loader import LoadedModel, load_model, resolve_dtype
from graphrt.lora.manager import LoRAManager
from graphrt.lora.slots import AdapterSlots
from graphrt.models.packed import use_packed_bf16
from graphrt.models.quantized import is_quantized, use_quant_tiles
from graphrt.multimodal.merge import install as install_mm
from graphrt.passes import PassManager
from graphrt.runner.decode_burst import DECODE_BURST
from graphrt.runner.graph_cache import CaptureSizes, GraphCache
from graphrt.runner.graph_key import GraphKey
from graphrt.runner.huge_pages import in_huge_page_block, move_to_huge_pages
from graphrt.runner.kv_cache import (
    KVCachePlan,
    allocate_kv_caches,
    auto_kv_dtype,
    bytes_per_block,
    plan_kv_cache,
    resolve_kv_cache_dtype,
)
from graphrt.runner.model_runner import ModelRunner
from graphrt.runner.page_warmer import KVPageWarmer, populate_supported
from graphrt.runner.profile_run import worst_case_step_memory
from graphrt.runner.step_module import MTPStepModule, StepModule, VerifyStepModule
from graphrt.serving_settings import (
    GraphCacheMismatchError,
    ServingSettings,
    adopt,
    differences,
    graphs_to_build,
    mismatch_message,
    model_identity,
)
from graphrt.spec.drafter import Drafter, MTPDrafter
from graphrt.spec.mtp import check_mtp
from graphrt.spec.stats import SpecStats
from graphrt.user_cache import default_graph_cache_dir, remembered
from graphrt.version import __version__

BUILD_WORKERS = max(1, min(4, os.cpu_count() or 1))  # graph packages built side by side


@dataclass(frozen=True)
class CaptureRecord:
    key: GraphKey
    how: str  # "compiled" or "loaded"
    seconds: float  # from the start of its capture until it was ready (builds overlap)


class EngineStartup:
    """The start-up half of ``LLMEngine`` (which sets ``config`` and calls ``start``)."""

    # --- start-up, in this order ---------------------------------------------------------------

    def start(self) -> EngineStartup:
        t0 = time.perf_counter()
        self.check_backend()
        self.open_graph_cache()
        self.load()
        self.configure()
        t1 = time.perf_counter()
        if self.kv_budget() is None:  # only a budget that is a share of free memory needs the profile
            self.activation_peak = remembered("profiles", self.profile_key(), self.profile_run)
        self.initialize_kv_cache()
        t2 = time.perf_counter()
        self.capture_model()
        self.time_decode_graphs()
        self.record_settings()
        self.startup_seconds = {"load": t1 - t0, "kv_cache": t2 - t1, "graphs": time.perf_counter() - t2}
        return self

    def check_backend(self) -> None:
        from graphrt.compiler.inner import INNER_BACKENDS
        from graphrt.npu.backend import MODES

        c = self.config
        if c.backend not in INNER_BACKENDS:
            raise ValueError(f"backend {c.backend!r} is not known; backends: {list(INNER_BACKENDS)}")
        if c.torchair_mode not in MODES:
            raise ValueError(f"torchair_mode {c.torchair_mode!r} is not known; modes: {list(MODES)}")
        if c.backend == "torchair" and c.compile:
            from graphrt.npu import torchair_package

            torchair_package.load()  # here, not mid-capture: TorchAirUnavailable names the fix

    def open_graph_cache(self) -> None:
        """The graph store: the per-user cache by default, a shipped directory when given (its
        recorded settings are read here), none for the eager backend (nothing to keep)."""
        c = self.config
        self.shipped_dir = isinstance(c.graph_cache, (str, os.PathLike))
        uses_store = c.compile and c.backend in ("inductor", "torchair") and c.graph_cache is not False
        root = os.fspath(c.graph_cache) if self.shipped_dir else default_graph_cache_dir()
        self.store = ArtifactStore(root, c.strict_graph_cache) if uses_store else None
        recorded = self.store.settings() if self.store is not None and self.shipped_dir else None
        self.shipped = ServingSettings.from_dict(recorded) if recorded else None

    def load(self) -> None:
        self.dtype = resolve_dtype(adopt(self.config.dtype, self.shipped, "dtype"))
        self.loaded: LoadedModel = load_model(self.config.model, self.dtype, self.config.quantization)
        if self.config.backend != "torchair" and quant_tiles.wanted(NATIVE_ISA):
            use_quant_tiles(self.loaded.model)  # quantized matrices as this CPU's products read them best
        if self.config.compile and self.config.backend != "torchair" and packed_bf16.wanted(NATIVE_PACKS_BF16):
            use_packed_bf16(self.loaded.model)  # bf16 ones too (eager mode reads them row-major, as aten does)
        if self.config.huge_pages:  # a decode step streams them all: 2 MiB pages, not 4 KiB
            move_to_huge_pages(self.loaded.model)

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
        kv_name = adopt(c.cache.kv_cache_dtype, shipped, "kv_cache_dtype")
        quantized = is_quantized(self.loaded.model)
        self.kv_dtype = resolve_kv_cache_dtype(kv_name, self.dtype, cfg, c.backend, quantized)
        auto_kv = auto_kv_dtype(self.dtype, cfg, c.backend, quantized)
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
            c.speculative_config.method if c.speculative_config is not None else "",
            "auto" if self.kv_dtype == auto_kv else str(self.kv_dtype).removeprefix("torch."),
        )
        self.max_blocks = -(-self.max_model_len // self.block_size)
        self.spec = c.speculative_config
        mtp = self.spec is not None and self.spec.method == "mtp"
        if mtp:
            check_mtp(self.loaded.model)
        # Every step graph returns its tokens' final hidden states: MTP drafts from them, and a
        # request's prompt log-probabilities and its sampled tokens' alternatives (logprobs=k)
        # are computed from them (runner/token_logprobs.py).
        self.lora = self.install_lora(num_seqs)
        self.mm_buffers = None
        if self.loaded.encoder is not None or c.enable_prompt_embeds:  # embeddings reach the graphs as buffers
            verify_tokens = num_seqs * (spec_k + 1)  # a verify step's slots, drafted or not
            max_tokens = max(self.sched_config.max_num_batched_tokens, verify_tokens, *sizes.mixed, *sizes.decode)
            self.mm_buffers = install_mm(self.loaded.model, max_tokens, self.dtype)
        self.step_module = StepModule(self.loaded.model, self.block_size, c.grammar_backend, return_hidden=True)
        self.verify_module, self.mtp_module, self.proposer, self.spec_stats = None, None, None, SpecStats()
        if self.spec is not None:
            self.spec.check_budget(self.sched_config.max_num_batched_tokens)
            self.verify_module = VerifyStepModule(
                self.loaded.model, self.block_size, self.spec.num_speculative_tokens, c.grammar_backend, True, mtp
            )
            if mtp:
                self.mtp_module = MTPStepModule(self.loaded.model, self.block_size, self.spec.num_speculative_tokens)
                self.proposer = MTPDrafter(self.spec, self._verify_cost_ratio)
            else:
                self.proposer = Drafter(self.spec, self._verify_cost_ratio)
        self.kv_config = dataclasses.replace(cfg, num_layers=cfg.num_layers + 1) if mtp else cfg  # + the MTP layer's
        self.grammar_compiler: GrammarCompiler | None = None  # built on the first constrained request
        self.graphs = GraphCache(
            sizes,
            num_seqs,
            self.max_blocks,
            -(-cfg.vocab_size // 32),
            spec_k,
            (cfg.hidden_size, self.dtype) if mtp else None,
            cfg.vocab_size if mtp else 0,
        )
        if mtp:
            self.graphs.mtp_max_blocks = -(-(self.max_model_len + self.spec.num_speculative_tokens) // self.block_size)
        if shipped is not None and not c.rebuild_graph_cache:
            self._check_shipped_settings()
        self.model_key = (
            model_key(cfg.to_dict(), self.dtype, self.step_module, self.block_size) if self.store is not None else None
        )

    def install_lora(self, max_rows: int) -> LoRAManager | None:
        """With LoRA on: adapter slots in the model (zeros: graph inputs like its weights) and the
        manager that fills them."""
        if self.config.lora is None:
            return None
        lora, cfg = self.config.lora, self.loaded.config
        if cfg.mla is not None or cfg.moe is not None:
            raise ValueError(f"LoRA serves the Llama family (Llama, Qwen2, Qwen3), not {cfg.architecture}")
        slots = AdapterSlots(self.loaded.model, cfg, lora.max_loras, lora.max_lora_rank, max_rows, lora.target_modules)
        return LoRAManager(slots, cfg, self.dtype)

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
            return self.shipped.kv_num_blocks * bytes_per_block(self.kv_config, self.block_size, self.kv_dtype)
        return None

    def profile_key(self) -> dict:
        """What the worst-case step's memory depends on (measured once, then remembered)."""
        s = self.sched_config
        return {
            "model": self.settings.model,
            "dtype": self.settings.dtype,
            "kv_cache_dtype": self.settings.kv_cache_dtype,
            "tokens": s.max_num_batched_tokens,
            "seqs": s.max_num_seqs,
            "max_blocks": self.max_blocks,
            "grammar_backend": self.config.grammar_backend,
            "graphrt": __version__,
            "images": self.config.limit_mm_per_prompt if self.loaded.encoder is not None else 0,
            "measure": 2,  # how it is measured: 2 resets the RSS high-water mark first (peak_growth)
        }

    def profile_run(self) -> int:
        """The worst-case step's peak memory growth in bytes (``runner/profile_run.py``)."""
        self.activation_peak = worst_case_step_memory(
            self.step_module, self.graphs, self.sched_config, self.loaded.config, self.kv_dtype, self.block_size
        )
        encoder = self.loaded.encoder
        if encoder is not None:  # a prompt's images are encoded before its step, their embeddings kept
            self.activation_peak = max(self.activation_peak, encoder.profile(self.config.limit_mm_per_prompt))
            self.activation_peak += encoder.cache_bytes
        return self.activation_peak

    def initialize_kv_cache(self) -> KVCachePlan:
        cache = dataclasses.replace(self.config.cache, block_size=self.block_size, kv_cache_memory=self.kv_budget())
        self.kv_plan = plan_kv_cache(self.kv_config, cache, self.kv_dtype, self.max_model_len, self.activation_peak)
        self.kv_caches = allocate_kv_caches(
            self.kv_config, self.kv_plan.num_blocks, self.block_size, self.kv_dtype, self.config.huge_pages
        )
        self.blocks = BlockManager(self.kv_plan.num_blocks, self.block_size, self.config.cache.enable_prefix_caching)
        self.page_warmer = self.start_page_warmer()
        self.scheduler = Scheduler(self.sched_config, self.blocks, self.lora)
        # decode bursts, where no step needs the one before it read back: MTP drafts from each
        # step's hidden states, and image embeddings are loaded a step at a time (a step with
        # n-gram drafts verifies them instead)
        if self.mtp_module is None and self.mm_buffers is None:
            self.scheduler.decode_burst = DECODE_BURST
        self.runner = ModelRunner(
            self.step_module,
            self.kv_caches,
            self.graphs,
            self.sched_config.max_num_seqs,
            self.max_model_len,
            self.verify_module,
            self.mtp_module,
            self.lora.slots if self.lora is not None else None,
            self.mm_buffers,
        )
        self.runner.bitmask_provider = self._fill_bitmask
        if self.mtp_module is not None:
            self.runner.steps["verify"].draft_probs_of = self.proposer.probs_of
        return self.kv_plan

    def start_page_warmer(self) -> KVPageWarmer | None:
        """Caches in huge pages: their pages faulted in ahead of the block pool, off the steps'
        path (``runner/page_warmer.py``). In 4 KiB pages a fault is cheap: none, unless the
        settings ask for the whole cache (``CacheConfig.prefault``)."""
        whole = self.config.cache.prefault
        if not (whole or in_huge_page_block(self.kv_caches[0][0])) or not populate_supported():
            return None
        pool = self.blocks.pool
        step_blocks = self.sched_config.max_num_batched_tokens // self.block_size + self.sched_config.max_num_seqs
        warmer = KVPageWarmer(self.kv_caches, lambda: pool.fresh, step_blocks, whole).start()
        weakref.finalize(self, warmer.stop, False)  # an engine dropped unclosed ends its thread
        return warmer

    def capture_model(self) -> list[CaptureRecord]:
        """Compile the graph of every key, largest first. Eager mode: nothing to capture."""
        self.capture_report: list[CaptureRecord] = []
        self.passes = PassManager(self.config.backend, self.config.passes_disabled)
        if not self.config.compile:
            return self.capture_report
        self.graphs.compiling = True
        steps = {"main": self.step_module, "verify": self.verify_module, "mtp": self.mtp_module}
        options = {"torchair_mode": self.config.torchair_mode} if self.config.backend == "torchair" else {}
        builder = GraphBuilder(
            steps, self.kv_caches, self.passes, self.config.backend, self.store, self.model_key, options
        )
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

    def time_decode_graphs(self) -> None:
        """With a drafter: every decode size's main, verify and MTP graphs replayed, so that it
        weighs drafts on measured costs from the first step (``StepTimes.seed``)."""
        if self.proposer is None or not self.graphs.graphs:
            return
        keys = []
        for rows in self.graphs.sizes.decode:
            if rows <= self.sched_config.max_num_seqs:
                main, verify, mtp_after_verify = self.graphs.decode_keys(rows)
                keys += [main, verify]
                if self.mtp_module is not None:
                    keys += [mtp_after_verify, self.graphs.key_for("mtp", rows, rows)]
        self.runner.step_times.seed(self.graphs.graphs, keys)

    def _captured(self, graph, how: str, seconds: float, bar) -> None:
        key = next(k for k in self.graphs.all_keys() if k.name == graph.name)
        self.graphs.graphs[key] = graph
        self.num_compiles += how == "compiled"
        self.capture_report.append(CaptureRecord(key, how, seconds))
        bar.update(1)
