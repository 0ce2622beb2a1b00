"""MTP speculation on DeepSeek-V3: the MTP step's drafts are transformers' MTP drafts at every
step (so its cache stays what was accepted), outputs are plain decoding's, graphs everywhere."""

import collections

import numpy as np
import pytest
import torch

import graphrt
from graphrt import SamplingParams
from graphrt.runner.graph_cache import CaptureSizes
from graphrt.serving_settings import GraphCacheMismatchError
from tests.helpers import drafting_always, make_llm
from tests.oracle import hf_model, random_prompts
from tests.tiny_models import make_mtp_oracle, save_tiny_with_mtp

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def mtp(k):
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def mtp_path(tiny_root):
    return save_tiny_with_mtp(tiny_root)


class TrueContinuation:
    """Replaces the MTP drafts (random weights: never right) with the plain run's tokens, every
    third one wrong, so verify steps accept runs and reject inside them; the MTP step still runs
    over every accepted token and its own drafts are recorded."""

    def __init__(self, drafter, runs, vocab=256):
        self.runs, self.vocab, self.made = runs, vocab, []
        self.remember = drafter.remember
        drafter.remember = self.record
        drafter.propose = self.propose

    def record(self, rid, num_tokens, drafts, probs=None):
        self.made.append((rid, num_tokens, list(drafts)))
        self.remember(rid, num_tokens, drafts, probs)

    def propose(self, req, room):
        seq = req.all_token_ids
        for run in self.runs:
            if run[: len(seq)] == seq:
                true = run[len(seq) : len(seq) + room]
                return [(t + 1) % self.vocab if (len(seq) + i) % 3 == 2 else t for i, t in enumerate(true)]
        return []


def oracle_first_draft(path, oracle, seq: list[int]) -> int:
    """transformers' MTP draft after ``seq``: its last token and the hidden state before it."""
    ids = torch.tensor(seq)
    n = len(seq)
    with torch.no_grad():
        h = hf_model(path)(ids[None, :-1], output_hidden_states=True).hidden_states[-1]
        out = oracle.forward_layer(0, h, torch.arange(1, n)[None], None, input_ids=ids[None, 1:])
        return int(oracle._project_to_logits(out)[0, -1].argmax())


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_are_transformers_mtp_drafts_at_every_step_and_output_is_plain(mtp_path, k):
    prompts = random_prompts([9, 14, 6], seed=11)
    opts = dict(max_num_seqs=3, max_num_batched_tokens=16, kv_cache_memory=1_000_000)  # chunked prefills
    plain = make_llm(mtp_path, **opts).generate(prompts, GREEDY)
    spec = drafting_always(make_llm(mtp_path, speculative_config=mtp(k), **opts))
    hook = TrueContinuation(spec.engine.proposer, [p + o.token_ids for p, o in zip(prompts, plain)])
    got = spec.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert all(0 < o.num_accepted_tokens < o.num_draft_tokens for o in got)
    full = {o.request_id: p + o.token_ids for p, o in zip(prompts, got)}
    oracle = make_mtp_oracle(hf_model(mtp_path))
    assert len(hook.made) > 20
    for rid, n, drafts in hook.made[::3]:
        assert len(drafts) == k
        assert drafts[0] == oracle_first_draft(mtp_path, oracle, full[rid][:n]), (rid, n)
    stats = spec.stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_mtp_under_preemption_prefix_caching_and_mixed_requests(mtp_path):
    shared = random_prompts([12], seed=12)[0]
    prompts = [shared + p for p in random_prompts([3, 8, 5, 2], seed=13)] + random_prompts([20], seed=14)
    params = [GREEDY] * 4 + [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)]  # never drafts
    opts = dict(max_num_seqs=4, max_num_batched_tokens=24, block_size=4, max_model_len=48)
    plain = make_llm(mtp_path, kv_cache_memory=4_000_000, **opts).generate(prompts, params)
    spec = drafting_always(
        make_llm(mtp_path, kv_cache_memory=21 * 2560, speculative_config=mtp(3), **opts)
    )  # 20 blocks
    TrueContinuation(spec.engine.proposer, [p + o.token_ids for p, o in zip(prompts, plain)])
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    stats = spec.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["free_blocks"] == stats["total_blocks"]


def chi_square_p_value(a: list[int], b: list[int]) -> tuple[float, int]:
    """Homogeneity of two samples of tokens (tokens seen fewer than 10 times pooled)."""
    counts = collections.Counter(a) + collections.Counter(b)
    common = sorted(t for t, c in counts.items() if c >= 10)
    table = torch.tensor(
        [[sum(1 for t in xs if t == c) for c in common] + [sum(1 for t in xs if t not in common)] for xs in (a, b)],
        dtype=torch.float64,
    )
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(chi2 / 2))), dof


def test_random_sampling_with_mtp_drafts_draws_from_the_target_distribution(mtp_path):
    """The MTP layer's own drafts (drawn from its distribution q, far from the target's with
    random weights) verified by the min(1, p/q) rule with residual draws: the second token of
    600 seeded requests, over the requests whose second token was verified, against plain
    sampling's — a chi-square test of homogeneity at α = 0.001. Unlike one-hot drafts, whose
    verified tokens are exactly plain sampling's, tokens verified by this rule depend on which
    steps verify: with that choice pinned, a seeded run repeats."""
    prompt = random_prompts([11], seed=15)[0]
    params = [
        SamplingParams(max_tokens=3, temperature=0.8, top_k=(0, 40)[s % 2], seed=s, ignore_eos=True) for s in range(600)
    ]
    opts = dict(max_num_seqs=8, kv_cache_memory=4_000_000)
    plain = [o.token_ids[1] for o in make_llm(mtp_path, **opts).generate([prompt] * 600, params)]
    spec = drafting_always(make_llm(mtp_path, speculative_config=mtp(1), **opts))
    out = spec.generate([prompt] * 600, params)
    drafted = [o.token_ids[1] for o in out if o.num_draft_tokens]
    stats = spec.stats()
    assert len(drafted) >= 150 and 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    p_value, dof = chi_square_p_value(plain, drafted)
    assert dof >= 3 and p_value > 0.001, (p_value, dof)
    again = drafting_always(make_llm(mtp_path, speculative_config=mtp(1), **opts)).generate([prompt] * 600, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in out]


def test_mtp_graphs_compile_once_and_load_from_a_shipped_cache(mtp_path, tmp_path):
    sizes = CaptureSizes(decode=(4,), mixed=(16,))
    opts = dict(max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory=1_000_000, capture_sizes=sizes)
    cache = str(tmp_path / "graphs")
    compiled = drafting_always(
        graphrt.LLM(mtp_path, progress=False, graph_cache=cache, speculative_config=mtp(2), **opts)
    )
    kinds = sorted(key.kind for key in compiled.engine.graphs.graphs)
    assert kinds == ["main", "main", "mtp", "mtp", "verify"] and compiled.stats()["compiles"] == 5
    for key, graph in compiled.engine.graphs.graphs.items():
        if key.kind == "mtp":  # the first pass and the chained draft: each one fused MLA and draft sampler
            counts = collections.Counter(
                str(n.target) for n in graph.gm.graph.nodes if n.op in ("call_function", "call_method")
            )
            assert counts["graphrt.mla_attention.default"] == 2 and counts["graphrt.draft_sample.default"] == 2
            assert not any("index_copy" in t or "einsum" in t or "sort" in t for t in counts), key
    # the drafter's costs are measured before the first step: every decode graph replayed (on
    # padding: the outputs below stay plain decoding's)
    graphs = compiled.engine.graphs
    timed = compiled.engine.runner.step_times.seconds
    assert all(timed[key] > 0 for key in (*graphs.decode_keys(4), graphs.key_for("mtp", 4, 4)))
    prompts = random_prompts([5, 9, 13], seed=16)
    want = make_llm(mtp_path, **opts).generate(prompts, GREEDY)
    got = compiled.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = compiled.stats()
    assert stats["compiles"] == 5 and stats["graph_misses"] == 0 and stats["spec_draft_tokens"] > 0
    warm = drafting_always(graphrt.LLM(mtp_path, progress=False, graph_cache=cache, speculative_config=mtp(2), **opts))
    assert warm.stats()["compiles"] == 0
    assert [o.token_ids for o in warm.generate(prompts, GREEDY)] == [o.token_ids for o in want]
    assert warm.stats()["graph_misses"] == 0
    # another chain length: its MTP and verify graphs are other graphs (a loaded k=2 MTP graph
    # would be wrong), so the shipped cache refuses it, counting one verify and two MTP graphs
    with pytest.raises(GraphCacheMismatchError, match=r"(?s)speculative_tokens: asked 1.*\n3 graph\(s\) would"):
        graphrt.LLM(mtp_path, progress=False, graph_cache=cache, speculative_config=mtp(1), **opts)
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(
        GraphCacheMismatchError, match="speculative_method: asked 'ngram', the graph cache was built with 'mtp'"
    ):
        graphrt.LLM(mtp_path, progress=False, graph_cache=cache, speculative_config=ngram, **opts)


def test_bad_mtp_configs(tiny_model, mtp_path):
    with pytest.raises(ValueError, match=r'method="mtp" needs the checkpoint\'s MTP layers; missing tensors'):
        make_llm(tiny_model("deepseek_v3"), speculative_config=mtp(1), kv_cache_memory=1_000_000)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MTP layers"):
        make_llm(tiny_model("llama_gqa"), speculative_config=mtp(1), kv_cache_memory=1_000_000)
    with pytest.raises(ValueError, match="num_speculative_tokens=16 is too large"):
        make_llm(mtp_path, speculative_config=mtp(16), max_num_batched_tokens=16, kv_cache_memory=1_000_000)
    llm = make_llm(
        mtp_path, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1}, kv_cache_memory=1_000_000
    )
    assert llm.engine.spec.method == "mtp"
    np.testing.assert_equal(len(llm.engine.kv_caches), llm.engine.loaded.config.num_layers + 1)
