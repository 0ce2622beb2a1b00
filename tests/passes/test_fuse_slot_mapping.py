"""fuse_slot_mapping in four beats, plus a formula with another block size that must not fuse."""

import operator

import torch

from graphrt.kernels import canonical
from tests.kernels.paged_batch import make_batch
from tests.passes.recording import RecordingBackend, count

OP = torch.ops.graphrt.slot_mapping.default


def step(positions, token_req, block_tables):
    slots = canonical.slot_mapping(positions, token_req, block_tables, 4)
    return slots * 1


def near_miss(positions, token_req, block_tables):
    block = block_tables[token_req, positions // 4]
    slots = block * 8 + positions % 8  # another block size in the multiply: not a slot mapping
    return torch.where(token_req >= 0, slots, -1) * 1


def batch():
    b = make_batch([(9, 9), (6, 1), (12, 5)], 4, 2, 1, 8, pad_tokens=2)
    return b.positions, b.token_req, b.block_tables


def test_slot_arithmetic_becomes_one_op():
    rec = RecordingBackend()
    args = batch()
    got = rec.compile(step)(*args)
    assert count(rec.before, operator.floordiv) == 1 and count(rec.before, OP) == 0
    assert count(rec.after, OP) == 1
    assert count(rec.after, operator.floordiv) == 0 and count(rec.after, operator.mod) == 0
    assert torch.equal(got, step(*args))
    assert rec.results["fuse_slot_mapping"].matched == 1


def test_other_block_size_is_not_rewritten():
    rec = RecordingBackend()
    args = batch()
    got = rec.compile(near_miss)(*args)
    assert count(rec.after, OP) == 0 and rec.results["fuse_slot_mapping"].matched == 0
    assert rec.results["fuse_slot_mapping"].unmatched == 1  # the report names the leftover
    assert torch.equal(got, near_miss(*args))
