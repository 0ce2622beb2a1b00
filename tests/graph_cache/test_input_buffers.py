"""InputBuffers.load: the tensors a graph reads hold the step's data, and whatever a larger step
left behind is reset to padding (no row, no slot, the null block, greedy)."""

import numpy as np
import pytest
import torch

from graphrt.runner.graph_key import GraphKey
from graphrt.runner.input_buffers import InputBuffers
from graphrt.runner.step_batch import StepBatch
from graphrt.runner.steps import token_layout

VOCAB_WORDS = 4


def batch(rows: int, tokens_per_row: int, width: int, bitmask: bool) -> StepBatch:
    """``rows`` rows of ``tokens_per_row`` tokens, every value distinct and non-zero."""
    n = np.full(rows, tokens_per_row, dtype=np.int64)
    qsl = np.concatenate(([0], np.cumsum(n)))
    t = int(qsl[-1])
    token_req = np.repeat(np.arange(rows), n)
    return StepBatch(
        req_ids=tuple(f"r{i}" for i in range(rows)),
        token_ids=np.arange(100, 100 + t, dtype=np.int64),
        positions=np.arange(7, 7 + t, dtype=np.int64),
        token_req=token_req,
        block_tables=np.arange(1, 1 + rows * width, dtype=np.int64).reshape(rows, width),
        seq_lens=np.arange(20, 20 + rows, dtype=np.int64),
        query_start_loc=qsl,
        logits_indices=qsl[1:] - 1,
        temperature=np.linspace(0.5, 1.0, rows, dtype=np.float32),
        top_k=np.arange(3, 3 + rows, dtype=np.int64),
        top_p=np.full(rows, 0.9, dtype=np.float32),
        min_p=np.full(rows, 0.05, dtype=np.float32),
        seeds=np.arange(11, 11 + rows, dtype=np.int64),
        offsets=np.arange(20, 20 + rows, dtype=np.int64),
        bitmask=np.arange(rows * VOCAB_WORDS, dtype=np.int32).reshape(rows, VOCAB_WORDS) if bitmask else None,
        samples=np.ones(rows, dtype=bool),
    )


def test_a_small_step_after_a_large_one_leaves_only_its_own_data_and_padding():
    # arrange: buffers of 8 tokens / 4 rows, loaded with a full step first
    bufs = InputBuffers(GraphKey("main", 8, 4), max_blocks=5, vocab_words=VOCAB_WORDS)
    bufs.load(batch(rows=4, tokens_per_row=2, width=5, bitmask=True))
    small = batch(rows=2, tokens_per_row=1, width=2, bitmask=False)
    # act
    bufs.load(small)
    # assert: the tensors (what the graph reads) hold the small step, then padding
    args = dict(zip(bufs.names, bufs.args()))
    assert args["input_ids"].tolist() == [100, 101, 0, 0, 0, 0, 0, 0]
    assert args["positions"].tolist() == [7, 8, 0, 0, 0, 0, 0, 0]
    assert args["token_req"].tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    assert args["block_tables"].tolist() == [[1, 2, 0, 0, 0], [3, 4, 0, 0, 0], [0] * 5, [0] * 5]
    assert args["seq_lens"].tolist() == [20, 21, 0, 0]
    assert args["query_start_loc"].tolist() == [0, 1, 2, 2, 2]  # padding rows: empty queries
    assert args["logits_indices"].tolist() == [0, 1, 0, 0]
    assert args["temperature"].tolist() == pytest.approx([0.5, 1.0, 0.0, 0.0])
    assert args["top_k"].tolist() == [3, 4, 0, 0]
    assert args["top_p"].tolist() == pytest.approx([0.9, 0.9, 1.0, 1.0])
    assert args["min_p"].tolist() == pytest.approx([0.05, 0.05, 0.0, 0.0])
    assert args["seeds"].tolist() == [11, 12, 0, 0]
    assert args["offsets"].tolist() == [20, 21, 0, 0]
    assert (args["bitmask"] == -1).all()  # no grammar this step: every token allowed


def test_a_step_larger_than_the_buffers_is_refused_and_leaves_them_as_they_were():
    # arrange
    bufs = InputBuffers(GraphKey("main", 4, 2), max_blocks=3, vocab_words=VOCAB_WORDS)
    bufs.load(batch(rows=2, tokens_per_row=2, width=3, bitmask=False))
    before = [a.clone() for a in bufs.args()]
    # act / assert
    with pytest.raises(ValueError, match="does not fit graph main-t4-r2"):
        bufs.load(batch(rows=3, tokens_per_row=1, width=3, bitmask=False))
    assert all(torch.equal(a, b) for a, b in zip(bufs.args(), before))


def test_a_step_that_fills_its_key_and_steps_without_grammars_after_one_with():
    # arrange: a decode step that fills its key (no padding rows), first with grammar masks
    bufs = InputBuffers(GraphKey("main", 2, 2), max_blocks=3, vocab_words=VOCAB_WORDS)
    bufs.load(batch(rows=2, tokens_per_row=1, width=3, bitmask=True))
    masked = bufs.bitmask.clone()
    # act: two steps without grammars
    bufs.load(batch(rows=2, tokens_per_row=1, width=3, bitmask=False))
    after_first = bufs.bitmask.clone()
    bufs.load(batch(rows=2, tokens_per_row=1, width=3, bitmask=False))
    # assert: the masks were the step's, then every token allowed, and stay so
    assert masked.tolist() == np.arange(2 * VOCAB_WORDS).reshape(2, VOCAB_WORDS).tolist()
    assert (after_first == -1).all() and (bufs.bitmask == -1).all()
    args = dict(zip(bufs.names, bufs.args()))
    assert args["input_ids"].tolist() == [100, 101]
    assert args["query_start_loc"].tolist() == [0, 1, 2]
    assert args["seq_lens"].tolist() == [20, 21]


@pytest.mark.parametrize("counts", [[1], [1, 1, 1], [3], [1, 4, 1], [2, 1], [0, 2]])
def test_token_layout_of_decode_steps_matches_the_general_layout(counts):
    # arrange: rows with some tokens already computed
    computed = np.array([5, 0, 17][: len(counts)], dtype=np.int64)
    n = np.array(counts, dtype=np.int64)
    qsl = np.concatenate(([0], np.cumsum(n)))
    token_req = np.repeat(np.arange(len(counts)), n)
    want = (computed[token_req] + np.arange(int(qsl[-1])) - qsl[token_req], token_req, qsl, computed + n)
    # act
    got = token_layout(computed.copy(), counts)
    # assert: positions, token_req, query_start_loc and seq_lens, value for value
    for g, w in zip(got, want):
        assert g.dtype == np.int64 and g.tolist() == w.tolist()
