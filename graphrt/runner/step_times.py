"""StepTimes: how long each graph key's steps take on this machine, measured as they run (the
runner times a whole step: its host work, the buffers' load, the graph and the read-back).

The drafter weighs a verify step's cost against a main step's with these: what a verify graph
costs relative to the main graph of the same rows depends on the machine (a weight-streaming
step at one row, a compute-bound one at eight), so it is measured, not assumed. At start-up each
decode graph is replayed a few times (``seed``), so the first steps are weighed on measured
costs too; then the steps as they run take over: their first few of a key are left out
(first-touch page faults, lazy initialisation), after that a moving mean.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from graphrt.runner.graph_key import GraphKey


class StepTimes:
    def __init__(self, skip: int = 2, weight: float = 0.2) -> None:
        self.skip, self.weight = skip, weight
        self.seen: dict[GraphKey, int] = {}
        self.mean: dict[GraphKey, float] = {}

    def record(self, key: GraphKey, seconds: float) -> None:
        n = self.seen.get(key, 0) + 1
        self.seen[key] = n
        if n <= self.skip:
            return
        old = self.mean.get(key)
        self.mean[key] = seconds if old is None else old + self.weight * (seconds - old)

    def seed(self, graphs: dict[GraphKey, Callable], keys: Iterable[GraphKey], repeats: int = 2) -> None:
        """Each of ``keys`` that has a graph and no time yet: its graph replayed on its buffers
        as they are (padding at start-up: writes land in the null block), once untimed, then the
        fastest of ``repeats``."""
        for key in keys:
            graph = graphs.get(key)
            if graph is None or key in self.mean:
                continue
            graph()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                graph()
                times.append(time.perf_counter() - start)
            self.mean[key] = min(times)

    def ratio(self, key: GraphKey, base: GraphKey) -> float | None:
        """``key``'s mean time over ``base``'s; None until both are measured."""
        if key not in self.mean or base not in self.mean:
            return None
        return self.mean[key] / self.mean[base]
