"""Decode bursts: a decode step's further steps, replayed on the same graph key within one engine step.

A step of decoding rows spends a few hundred microseconds of host work around its graph: the
schedule, the batch, the buffers, the tokens through the stop checks. In a burst (the scheduler's
``decode_steps``) that work is done once, and each further step only advances the key's buffers in
place — each row's sampled token becomes its next input, its position, length and sampling offset
grow by one — and replays the graph. The block tables were loaded wide enough for the burst's last
step, so the fused slot mapping finds every new token's slot.

The tokens are the ones single steps would sample: the same graph, inputs and sampling offsets
(a seeded random row draws from the same (seed, offset) streams). A burst ends early after a step
in which a row sampled one of its stop tokens; the steps not run are reported as rejected, as a
verify step's drafts are, so the scheduler advances each row by the tokens it got. A stop string
is found by the engine afterwards: the tokens after it are dropped there, as after any step.
"""

from __future__ import annotations

from collections.abc import Callable

from graphrt.runner.input_buffers import InputBuffers
from graphrt.runner.step_batch import StepBatch
from graphrt.runner.steps import ModelRunnerOutput

# The longest burst. Each further step saves the host's work around one (about 0.3 ms on a 2-core
# CPU); a longer burst delays a request that arrives meanwhile, and a stop string found after it
# wastes its steps (a stop token ends the burst at once).
DECODE_BURST = 4


# the buffers a further step changes, as ``advance`` takes them
ADVANCED = ("input_ids", "positions", "seq_lens", "offsets")


def views(buffers: InputBuffers) -> tuple[memoryview, ...]:
    """The ADVANCED buffers as memoryviews: set item by item from Python they cost 7-14 µs a step
    at 1-32 rows, where numpy's four slice operations cost 20-24 µs (both cold, as between two
    replays of a step's graph, whose weight streams evict them)."""
    return tuple(memoryview(buffers.host[n]) for n in ADVANCED)


def advance(advanced: tuple[memoryview, ...], tokens: list[int]) -> None:
    """The buffers (``views``) after one decode step of ``len(tokens)`` rows, one token a row: each
    row's sampled token in, its position, length and sampling offset one further."""
    ids, positions, seq_lens, offsets = advanced
    for i, token in enumerate(tokens):
        ids[i] = token
        positions[i] += 1
        seq_lens[i] += 1
        offsets[i] += 1


def run_burst(
    first: ModelRunnerOutput,
    batch: StepBatch,
    buffers: InputBuffers,
    steps: int,
    replay: Callable[[], tuple],
    stop_ids: dict[str, frozenset[int]],
) -> ModelRunnerOutput:
    """``first``: the burst's first step as read; its rows gain one token and log-probability a
    further step, up to ``steps`` in all."""
    req_ids, r = batch.req_ids, batch.num_reqs
    tokens = [first.sampled[rid][0] for rid in req_ids]
    advanced = views(buffers)
    done = 1
    while done < steps and not any(t in stop_ids[rid] for t, rid in zip(tokens, req_ids)):
        advance(advanced, tokens)
        new_tokens, logprobs, *_ = replay()
        tokens, logprobs = new_tokens.tolist()[:r], logprobs.tolist()[:r]
        for i, rid in enumerate(req_ids):
            first.sampled[rid].append(tokens[i])
            first.logprobs[rid].append(logprobs[i])
        done += 1
    if done < steps:
        first.num_rejected = {rid: steps - done for rid in req_ids}
    return first
