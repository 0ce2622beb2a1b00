"""``graphrt bench spec --method mtp``: plain decoding against MTP speculation on DeepSeek-V3.

Without ``--model``, a random DeepSeek-V3 with ``--layers`` layers and one MTP layer (the last
layer's weights under DeepSeek's MTP names) is written to the per-user cache and used. With
random weights the MTP drafts are never right, so three MTP runs sit beside plain decoding, in
one run, interleaved: the MTP layer's own drafts, and drafts forced to a given accuracy (the
plain run's own tokens, each right with probability ``accuracy``: 1.0 and 0.3), whose MTP steps
still run; all-right drafts are always verified (the cost model pinned: what MTP yields when its
drafts are right), 30%-right ones as the cost model decides; ``rounds`` runs of each, medians
taken, and a second plain engine beside the first to show how far two identical engines fall
apart in the same run. Reported: decode tokens/s and speed-up, acceptance, mean accepted length,
each step kind's cost against a main step (its graph replayed after the runs), and for all-right
drafts the speed-up those costs predict: k + 1 tokens a row per round of one verify and one MTP
step, against one token a row per main step.
"""

from __future__ import annotations

import os
import random
import time

from graphrt.bench.common import median
from graphrt.user_cache import cache_root


def write_random_deepseek(path: str, layers: int, seed: int = 0) -> str:
    """A random DeepSeek-V3 checkpoint (MLA with q LoRA, MoE with a shared expert and grouped
    routing, YaRN) with one MTP layer; written once."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg = transformers.DeepseekV3Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=4096,
        initializer_range=0.05,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=1024,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    )
    torch.manual_seed(seed)
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    last, mtp, h = f"model.layers.{layers - 1}.", f"model.layers.{layers}.", cfg.hidden_size
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[mtp + name.removeprefix(last)] = tensors[name].clone()
    tensors[mtp + "enorm.weight"] = torch.ones(h)
    tensors[mtp + "hnorm.weight"] = torch.ones(h)
    tensors[mtp + "shared_head.norm.weight"] = torch.ones(h)
    tensors[mtp + "eh_proj.weight"] = torch.randn(h, 2 * h) * 0.05
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


class ForcedDrafts:
    """Drafts from the plain run's tokens, each right with probability ``accuracy`` (a seeded
    choice per position), in place of the MTP layer's, for requests still drafting with it."""

    def __init__(self, drafter, accuracy: float, vocab: int) -> None:
        self.accuracy, self.vocab, self.runs = accuracy, vocab, []
        self.drafter = drafter
        drafter.propose = self.propose

    def propose(self, req, room: int) -> list[int]:
        if req.request_id in self.drafter.left:  # gone from the MTP layer: it makes no drafts
            return []
        seq = req.all_token_ids
        for run in self.runs:
            if run[: len(seq)] == seq:
                out = []
                for i, t in enumerate(run[len(seq) : len(seq) + room]):
                    right = random.Random(len(seq) * 131 + i).random() < self.accuracy
                    out.append(t if right else (t + 1) % self.vocab)
                return out
        return []


def _replay(llm, key, repeats: int = 20) -> float | None:
    """Median seconds of one replay of the engine's graph for ``key`` (None: no such graph)."""
    graph = llm.engine.graphs.graphs.get(key)
    if graph is None:
        return None
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        graph()
        times.append(time.perf_counter() - start)
    return median(times)


def _timed(llm, prompts, params) -> tuple[list[list[int]], float]:
    tokens = [[] for _ in prompts]
    first = None
    for ev in llm.generate_stream(prompts, params):
        tokens[ev.index].extend(ev.token_ids)
        if first is None and all(tokens):
            first = time.perf_counter()
    return tokens, time.perf_counter() - first


def bench_mtp(
    model, dtype: str, batch_sizes: list[int], ks: list[int], gen_len: int, layers: int = 8, rounds: int = 5
) -> dict:
    from graphrt.llm import LLM
    from graphrt.runner.graph_cache import CaptureSizes
    from graphrt.sampling_params import SamplingParams

    if model is None:
        model = write_random_deepseek(os.path.join(cache_root(), "bench", f"deepseek-v3-random-{layers}l"), layers)
    budget = 128
    common = dict(
        dtype=dtype,
        max_model_len=512,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=budget,
        capture_sizes=CaptureSizes(decode=tuple(sorted(set(batch_sizes))), mixed=(16, 32, 64, budget)),
        progress=False,
    )
    # a second plain engine: how far two identical engines' speeds fall apart in this run
    engines = {"plain": LLM(model, **common), "plain (again)": LLM(model, **common)}
    vocab = engines["plain"].engine.loaded.config.vocab_size
    forced = {}
    for k in ks:
        config = {"method": "mtp", "num_speculative_tokens": k}
        engines[f"mtp k={k}"] = LLM(model, speculative_config=config, **common)
        for accuracy in (1.0, 0.3):
            name = f"mtp k={k} drafts {accuracy:.0%} right"
            engines[name] = LLM(model, speculative_config=config, **common)
            forced[name] = ForcedDrafts(engines[name].engine.proposer, accuracy, vocab)
            if accuracy == 1.0:  # what MTP yields when drafts are right: every step verifies
                engines[name].engine.proposer.cost_ratio = lambda rows: 1.0
    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    results = []
    for batch in batch_sizes:
        prompts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(batch)]
        plain_tokens, _ = _timed(engines["plain"], prompts, params)  # the runs forced drafts replay
        for f in forced.values():
            f.runs = [p + t for p, t in zip(prompts, plain_tokens)]
        times: dict[str, list[float]] = {name: [] for name in engines}
        outputs = {}
        for name in engines:
            engines[name].engine.spec_stats.__init__()
        for _ in range(rounds):
            for name, llm in engines.items():
                tokens, seconds = _timed(llm, prompts, params)
                times[name].append(seconds)
                outputs[name] = tokens
        base = median(times["plain"])
        # step costs: each graph replayed on its last inputs, right after the runs
        t_main = _replay(engines["plain"], engines["plain"].engine.graphs.key_for("main", batch, batch))
        for name, llm in engines.items():
            row = {
                "batch": batch,
                "engine": name,
                "tokens_per_s": sum(len(t) - 1 for t in outputs[name]) / median(times[name]),
                "speedup": base / median(times[name]),
                "same_output": outputs[name] == outputs["plain"],
            }
            if not name.startswith("plain"):
                e = llm.engine
                stats = llm.stats()
                row["acceptance"] = stats["spec_acceptance_rate"]
                row["mean_accepted_length"] = stats["spec_mean_accepted_length"]
                k = e.spec.num_speculative_tokens
                _, verify_key, mtp_key = e.graphs.decode_keys(batch)
                verify, mtp = _replay(llm, verify_key), _replay(llm, mtp_key)
                mtp_after_main = _replay(llm, e.graphs.key_for("mtp", batch, batch))
                row["cost"] = {
                    "verify/main": verify / t_main,
                    "mtp after verify/main": mtp / t_main,
                    "mtp after main/main": mtp_after_main / t_main,
                }
                if name.endswith("100% right"):
                    row["predicted_speedup"] = (k + 1) * t_main / (verify + mtp)
            results.append(row)
            line = (
                f"batch {batch}  {name:<28} {row['tokens_per_s']:7.1f} decode tok/s  {row['speedup']:.2f}x  "
                f"same output: {row['same_output']}"
            )
            if not name.startswith("plain"):
                c = row["cost"]
                line += (
                    f"  acceptance {row['acceptance']:.2f}, mean accepted length {row['mean_accepted_length']:.2f}; "
                    f"cost/main: verify {c['verify/main']:.2f}, mtp {c['mtp after verify/main']:.2f} "
                    f"(after a main step {c['mtp after main/main']:.2f})"
                )
                if "predicted_speedup" in row:
                    line += f"; predicted {row['predicted_speedup']:.2f}x"
            print(line)
    return {"results": results, "model": str(model), "gen_len": gen_len}
