"""graphrt.LLM: the Python entry point. Batch generation, streaming, stats."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from graphrt.engine import EngineConfig, LLMEngine
from graphrt.lora.config import LoRAConfig
from graphrt.lora.request import LoRARequest
from graphrt.outputs import RequestOutput, StreamEvent
from graphrt.runner.graph_cache import CaptureSizes
from graphrt.runner.kv_cache import CacheConfig
from graphrt.sampling_params import InvalidRequestError, SamplingParams
from graphrt.spec.config import SpeculativeConfig

Prompt = str | list[int]


def per_prompt_values(value, n: int, what: str) -> list:
    """One value for every prompt, or a list of one per prompt (its length checked)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(f"got {len(value)} {what} for {n} prompts")
        return list(value)
    return [value] * n


class LLM:
    def __init__(
        self,
        model: Any = None,
        dtype: str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        kv_cache_memory: int | None = None,
        kv_cache_fraction: float = 0.1,
        block_size: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        capture_sizes: CaptureSizes | None = None,
        compile: bool = True,
        backend: str = "inductor",
        passes_disabled: Sequence[str] = (),
        progress: bool = True,
        graph_cache: str | bool | None = None,
        strict_graph_cache: bool = False,
        grammar_backend: str = "in-graph",
        rebuild_graph_cache: bool = False,
        speculative_config: dict | None = None,
        torchair_mode: str = "max-autotune",
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        lora_target_modules: Sequence[str] | None = None,
        quantization: str | None = None,
        limit_mm_per_prompt: int = 4,
        enable_prompt_embeds: bool = False,
        huge_pages: bool = True,
        prefault_kv_cache: bool = False,
        kv_cache_dtype: str | None = None,
    ) -> None:
        """Load ``model`` and start serving it. Settings left as None come from a shipped graph
        cache (``graph_cache=DIR``, as ``graphrt precompile`` wrote it) when there is one, else
        from the defaults: float32, 8 sequences, 256 batched tokens, blocks of 16 tokens.
        ``graph_cache``: None keeps compiled graphs in the per-user cache, False keeps none.
        ``speculative_config``: vLLM's keys, e.g. ``{"method": "ngram", "num_speculative_tokens": 3,
        "prompt_lookup_max": 3, "prompt_lookup_min": 1}``: drafts verified by verify graphs.
        ``quantization``: None runs the weights as stored (a Q4_0/Q4_1/Q8_0 GGUF stays int4/int8,
        read by quantized kernels); "int8" / "int4" quantize a float checkpoint at load (blocks of
        32 values: int8 symmetric as Q8_0, int4 with a minimum as Q4_1); "none" dequantises
        everything to ``dtype``. ``limit_mm_per_prompt``: images a prompt may hold (a
        vision-language model; the memory profile encodes that many). ``enable_prompt_embeds``:
        accept ``{"prompt_token_ids": ids, "prompt_embeds": [len(ids), hidden]}`` prompts, whose
        embeddings replace the token embeddings (every graph then reads two more buffers).
        ``huge_pages``: the weights and KV caches in 2 MiB pages where the kernel grants them
        (decode steps 5% faster in int4, 18% in fp32 here; start-up and a fresh process's first
        steps pay for the pages: ``graphrt generate``, a one-off, turns it off). The KV cache's pages
        are faulted in on a thread just ahead of the blocks handed out (in huge pages);
        ``prefault_kv_cache``: all of them, from start-up, so that a server reaches its steady
        speed once they are in (SmolLM2's 2.4 GB: seconds to a minute of background faults).
        ``kv_cache_dtype``: "bfloat16" under a float32 model halves the cache (twice the tokens in
        a budget, half the K/V a decode step reads), rounding K/V to bf16 on the write while q, the
        scores and the outputs stay float32; "float32" keeps them float32; "auto" keeps K/V in the
        model's dtype, except under int4/int8 weights, where it is "bfloat16" (the weights' rounding
        dwarfs the cache's; ``runner/kv_cache.py``, ``auto_kv_dtype``)."""
        if not isinstance(limit_mm_per_prompt, int) or isinstance(limit_mm_per_prompt, bool) or limit_mm_per_prompt < 0:
            raise ValueError(f"limit_mm_per_prompt must be an int >= 0, got {limit_mm_per_prompt!r}")
        cache = CacheConfig(
            block_size, kv_cache_memory, kv_cache_fraction, enable_prefix_caching, prefault_kv_cache, kv_cache_dtype
        )
        config = EngineConfig(
            model,
            dtype,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            cache,
            seed,
            capture_sizes,
            progress,
            compile,
            backend,
            tuple(passes_disabled),
            grammar_backend,
            graph_cache,
            strict_graph_cache,
            rebuild_graph_cache,
            SpeculativeConfig.from_dict(speculative_config),
            torchair_mode,
            LoRAConfig(max_loras, max_lora_rank, *([tuple(lora_target_modules)] if lora_target_modules else []))
            if enable_lora
            else None,
            quantization,
            limit_mm_per_prompt,
            enable_prompt_embeds,
            huge_pages,
        )
        self.engine = LLMEngine(config).start()

    def pass_report(self) -> list[str]:
        """Which pass matched how many times in which graph."""
        return self.engine.passes.report.lines()

    def capture_report(self):
        """Per graph key: compiled or loaded, seconds, memory."""
        return list(self.engine.capture_report)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def _submit(self, prompts: Sequence[Prompt] | Prompt, params, chat: bool, lora_request=None) -> list[str]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        loras = per_prompt_values(lora_request, len(prompts), "LoRA requests")
        per_prompt = per_prompt_values(params, len(prompts), "sampling params")
        # Validate everything before queueing anything: a bad prompt rejects the whole call and
        # leaves the engine serving whatever else it runs.
        token_ids, images = [], []
        for i, (p, sp) in enumerate(zip(prompts, per_prompt)):
            try:
                ids, mm = self._prompt_ids(p, chat)
                token_ids.append(ids)
                images.append(mm)
                params = SamplingParams.from_dict(sp) if isinstance(sp, dict) else sp
                if isinstance(params, SamplingParams):
                    self.engine.validate_params(params)  # grammars compile here (cached for add_request)
                self.engine.register_lora(loras[i])  # an adapter's directory is read and checked here
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompt {i}: {e}") from None
        return [
            self.engine.add_request(ids, sp, False, lora, mm_input=mm)
            for ids, sp, lora, mm in zip(token_ids, per_prompt, loras, images)
        ]

    def _prompt_ids(self, prompt, chat: bool) -> tuple[list[int], object]:
        """Token ids (and encoded images) of a prompt: text, token ids, a conversation, or vLLM's
        dict ``{"prompt": text | "prompt_token_ids": ids, "multi_modal_data": {"image": ...}}``."""
        if not isinstance(prompt, dict):
            return self.engine.tokenize(prompt, chat), None
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "prompt_embeds"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise InvalidRequestError(
                "a dict prompt holds 'prompt' (text) or 'prompt_token_ids', and optionally 'multi_modal_data'; "
                f"got keys {sorted(prompt)}"
            )
        ids = self.engine.tokenize(prompt.get("prompt", prompt.get("prompt_token_ids")), chat)
        if "prompt_embeds" in prompt:
            if "multi_modal_data" in prompt:
                raise InvalidRequestError("a prompt takes prompt_embeds or multi_modal_data, not both")
            return ids, self.engine.prepare_embeds(ids, prompt["prompt_embeds"])
        data = prompt.get("multi_modal_data")
        return self.engine.prepare_images(ids, data) if data is not None else (ids, None)

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        sampling_params: SamplingParams | dict | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None) per prompt."""
        ids = self._submit(prompts, sampling_params, chat, lora_request)
        pending = set(ids)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or len(ids) < 2)
        while pending:
            self.engine.step()
            done = {rid for rid in pending if self.engine.output(rid).finished}
            bar.update(len(done))
            pending -= done
        bar.close()
        outputs = [self.engine.output(rid) for rid in ids]
        for rid in ids:
            self.engine.release(rid)
        return outputs

    def generate_stream(
        self,
        prompts: Sequence[Prompt] | Prompt,
        sampling_params: SamplingParams | dict | Sequence[SamplingParams] | None = None,
        chat: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield each request's new text (and tokens) as it is produced; the last event of a
        request carries its finish_reason."""
        ids = self._submit(prompts, sampling_params, chat, lora_request)
        index = {rid: i for i, rid in enumerate(ids)}
        sent = {rid: 0 for rid in ids}
        pending = set(ids)
        while pending:
            self.engine.step()
            for rid in ids:
                if rid not in pending:
                    continue
                out = self.engine.output(rid)
                text = self.engine.detokenizer(rid).stream_delta(out.finished)
                new_tokens = tuple(out.token_ids[sent[rid] :])
                if text or new_tokens or out.finished:
                    sent[rid] = len(out.token_ids)
                    yield StreamEvent(index[rid], rid, text, new_tokens, out.finish_reason)
                if out.finished:
                    pending.discard(rid)
                    self.engine.release(rid)


def compile(model: Any = None, *, backend: str = "inductor", passes_disabled=(), **llm_kwargs) -> LLM:
    """Compile ``model`` (a graphrt model, a Hugging Face directory, a .gguf path, an in-memory
    transformers model, or None for the embedded default) into a runtime with one captured graph
    per graph key; returns the ``graphrt.LLM`` that serves it.

        llm = graphrt.compile("path/to/model")            # same as graphrt.LLM(..., compile=True)
        llm.pass_report()                                 # what each pass matched in which graph
    """
    return LLM(model, compile=True, backend=backend, passes_disabled=passes_disabled, **llm_kwargs)
