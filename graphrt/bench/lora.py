"""``graphrt bench decode --lora N``: decode with N LoRA adapters spread over the batch against the
base model, both compiled, on the same prompts, rounds interleaved."""

from __future__ import annotations

import json
import os
import tempfile

import torch

from graphrt.bench.common import machine_facts, median, print_facts
from graphrt.bench.decode import random_prompts, run_graphrt

TARGETS = {
    "qv": ("q_proj", "v_proj"),  # PEFT's default for the Llama family
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def write_random_adapter(path: str, cfg, targets: tuple[str, ...], rank: int, seed: int) -> str:
    """A PEFT-layout adapter of random weights for a model of config ``cfg``."""
    from safetensors.torch import save_file

    from graphrt.lora.adapter import part_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = part_shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            where = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def bench_lora(
    model: str | None,
    dtype: str,
    adapters: int,
    batch: int,
    prompt_len: int,
    gen_len: int,
    graph_cache: str | None,
    targets: str = "all",
    rank: int = 16,
    rounds: int = 3,
) -> dict:
    from graphrt import LLM, LoRARequest
    from graphrt.runner.graph_cache import CaptureSizes

    facts = machine_facts(dtype)
    print_facts(facts)
    common = dict(
        dtype=dtype,
        max_num_seqs=batch,
        max_num_batched_tokens=batch * prompt_len,
        max_model_len=prompt_len + gen_len + 16,
        capture_sizes=CaptureSizes(decode=(batch,), mixed=(batch * prompt_len,)),
        graph_cache=graph_cache,
        progress=True,
    )
    base = LLM(model, **common)
    lora = LLM(
        model, enable_lora=True, max_loras=adapters, max_lora_rank=rank, lora_target_modules=TARGETS[targets], **common
    )
    cfg = base.engine.loaded.config
    prompts = random_prompts(batch, prompt_len, cfg.vocab_size, seed=batch)
    with tempfile.TemporaryDirectory() as tmp:
        requests = [
            LoRARequest(f"adapter{i}", i + 1, write_random_adapter(f"{tmp}/a{i}", cfg, TARGETS[targets], rank, i))
            for i in range(adapters)
        ]
        per_prompt = [requests[i % adapters] for i in range(batch)]
        run_graphrt(base, prompts, 4)
        run_graphrt(lora, prompts, 4, per_prompt)
        base_runs, lora_runs = [], []
        for _ in range(rounds):  # interleaved: the machine drifts between minutes
            base_runs.append(run_graphrt(base, prompts, gen_len)["decode_tok_s"])
            lora_runs.append(run_graphrt(lora, prompts, gen_len, per_prompt)["decode_tok_s"])
    result = {
        "machine": facts,
        "batch": batch,
        "adapters": adapters,
        "rank": rank,
        "targets": list(TARGETS[targets]),
        "base_tok_s": base_runs,
        "lora_tok_s": lora_runs,
        "lora_over_base": median(lora_runs) / median(base_runs),
        "compiles_after_start": lora.stats()["compiles"] - len(lora.capture_report()),
    }
    print(
        f"batch {batch}, {adapters} adapters of rank {rank} on {targets}: base {median(base_runs):.1f} tok/s, "
        f"LoRA {median(lora_runs):.1f} tok/s ({100 * (1 - result['lora_over_base']):.1f}% slower)"
    )
    return result
