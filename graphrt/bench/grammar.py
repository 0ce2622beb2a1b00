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
    print(f"batch {batch}: unconstrained step {result['free_step_ms']:.2f} ms, constrained (JSON) step "
          f"{result['constrained_step_ms']:.2f} ms: overhead {100 * result['overhead_frac']:.1f}%")
    return result
