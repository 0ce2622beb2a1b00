"""``graphrt bench grammar``: a constrained decode step against an unconstrained one, interleaved."""

from __future__ import annotations

import time

from graphrt.bench.common import median


def _steps(llm, prompts, params, steps: int) -> list[float]:
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()  # prefill
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for r in ids:
        engine.abort(r)
        engine.release(r)
    return times


def bench_grammar(llm, batch: int = 4, steps: int = 16, rounds: int = 3) -> dict:
    from graphrt import SamplingParams

    prompts = [[100 + i, 200 + i, 300 + i] for i in range(batch)]
    free = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=steps + 4, temperature=0, json_object=True)
    _steps(llm, prompts, constrained, 2)  # compile the grammar once
    base, gram = [], []
    for _ in range(rounds):
        base += _steps(llm, prompts, free, steps)
        gram += _steps(llm, prompts, constrained, steps)
    result = {"batch": batch, "free_step_ms": 1e3 * median(base), "constrained_step_ms": 1e3 * median(gram)}
    result["overhead_frac"] = result["constrained_step_ms"] / result["free_step_ms"] - 1
    result.update(_pieces(llm, batch))
    print(
        f"batch {batch}: unconstrained step {result['free_step_ms']:.2f} ms, constrained (JSON) step "
        f"{result['constrained_step_ms']:.2f} ms: overhead {100 * result['overhead_frac']:.1f}%"
    )
    print(
        f"  the pieces: matcher fill {result['fill_ms']:.3f} ms a row; sample op {result['sample_ms']:.3f} ms "
        f"without a bitmask, {result['sample_masked_ms']:.3f} ms with; the xgrammar CPU round trip "
        f"{result['xgrammar_cpu_ms']:.3f} ms"
    )
    return result


def _pieces(llm, batch: int, repeats: int = 50) -> dict:
    """The grammar's own costs, timed alone: they are small against a step, and noise hides them."""
    import torch

    from graphrt import SamplingParams
    from graphrt.grammar import RequestGrammar
    from graphrt.grammar.reference_op import xgrammar_bitmask_cpu

    vocab = llm.engine.loaded.config.vocab_size
    engine = llm.engine
    grammar = RequestGrammar(engine._compiled_grammar(SamplingParams(json_object=True)), vocab)
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32).numpy()
    logits = torch.randn(batch, vocab)
    mask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    mask[:, : row.shape[0]] = 0
    mask[:, 0] = 0x7FFFFFFF
    args = (
        logits,
        torch.zeros(batch),
        torch.zeros(batch, dtype=torch.long),
        torch.ones(batch),
        torch.zeros(batch),
        torch.zeros(batch, dtype=torch.long),
        torch.zeros(batch, dtype=torch.long),
    )

    def ms(fn) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1e3 * (time.perf_counter() - t) / repeats

    return {
        "fill_ms": ms(lambda: grammar.fill(row)),
        "sample_ms": ms(lambda: torch.ops.graphrt.sample(*args, None)),
        "sample_masked_ms": ms(lambda: torch.ops.graphrt.sample(*args, mask)),
        "xgrammar_cpu_ms": ms(lambda: xgrammar_bitmask_cpu(logits, mask)),
    }
