"""The speculative config's checks and the n-gram proposer."""

import numpy as np
import pytest

import graphrt
from graphrt.spec import NgramProposer, SpeculativeConfig


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, r"method='eagle' is not known; methods: \['ngram', 'mtp'\]"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens=2.5 must be an integer"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= "),
        ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min=0 must be an integer >= 1"),
        ({"method": "ngram", "lookahead": 2}, r"keys \['lookahead'\] are not known"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ("ngram", "must be a dict"),
    ],
)
def test_invalid_configs_are_rejected_by_name(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)


def test_k_too_large_for_the_token_budget_is_rejected_at_construction(tiny_model):
    with pytest.raises(ValueError, match=r"num_speculative_tokens=16 is too large.*max_num_batched_tokens=16"):
        graphrt.LLM(
            tiny_model("llama_gqa"),
            compile=False,
            progress=False,
            max_num_batched_tokens=16,
            kv_cache_memory=2_000_000,
            speculative_config={"method": "ngram", "num_speculative_tokens": 16},
        )


@pytest.mark.parametrize(
    "tokens, n_max, n_min, k, want",
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3, [4, 5, 1]),  # the longest n first
        ([1, 2, 3, 9, 9, 9, 1, 2], 3, 1, 3, [3, 9, 9]),  # no 3-gram match: the 2-gram's
        ([1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 2, [8, 1]),  # the most recent occurrence wins
        ([1, 2, 3, 4, 1, 2], 3, 1, 5, [3, 4, 1, 2]),  # fewer than k follow: what there is
        ([5, 6, 7, 8], 3, 1, 3, []),  # nothing repeats
        ([7], 3, 1, 3, []),  # shorter than any n-gram with a follower
        ([3, 3], 3, 2, 3, []),  # shorter than prompt_lookup_min + 1: no draft, no error
    ],
)
def test_ngram_proposals(tokens, n_max, n_min, k, want):
    assert NgramProposer(k, n_max, n_min).propose(np.array(tokens, dtype=np.int64)) == want


def test_ngram_agrees_with_a_naive_search():
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(0, 4, size=rng.integers(1, 30))
        got = NgramProposer(3, 3, 1).propose(tokens)
        want = []
        for n in range(3, 0, -1):
            if len(tokens) <= n:
                continue
            tail = list(tokens[-n:])
            hits = [i for i in range(len(tokens) - n) if list(tokens[i : i + n]) == tail]
            if hits:
                want = list(tokens[hits[-1] + n : hits[-1] + n + 3])
                break
        assert got == want, tokens
