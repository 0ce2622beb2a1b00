"""Small shared helpers for the test suite."""

import graphrt
from graphrt.runner.graph_cache import CaptureSizes

# an engine whose step graphs are rewritten by the passes and replayed as Python (no Inductor
# compile): one decode graph of 4 rows, one mixed graph of 32 tokens
EAGER_GRAPHS = dict(
    compile=True,
    backend="eager",
    max_num_seqs=4,
    max_num_batched_tokens=32,
    capture_sizes=CaptureSizes(decode=(4,), mixed=(32,)),
    max_model_len=64,
)


def make_llm(model, **kwargs):
    """An engine in eager mode (no graph compiles) unless the test asks for compile=True."""
    return graphrt.LLM(model, **{"compile": False, "progress": False, **kwargs})


def drafting_always(llm):
    """Pin the drafter's cost model: a step with drafts costs one main step, so every step that
    has drafts verifies them. Tests of what verification does use it (which steps draft is a
    measured choice, tested on its own in tests/spec/test_drafter.py)."""
    llm.engine.proposer.cost_ratio = lambda rows: 1.0
    return llm


def stop_token_case(path, at: int):
    """An eager engine over ``path``, a 9-token prompt, transformers' 20 greedy tokens after it,
    the token at ``at`` of those as a stop token, and where it first occurs."""
    from tests.oracle import hf_greedy, random_prompts

    llm = make_llm(path, kv_cache_memory=4_000_000)
    prompt = random_prompts([9], seed=12)[0]
    full = hf_greedy(path, prompt, 20)
    return llm, prompt, full, full[at], full.index(full[at])
