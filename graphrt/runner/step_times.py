"""StepTimes: how long each graph key's steps take on this machine, measured as they run (the
runner times a whole step: its host work, the buffers' load, the graph and the read-back).

The drafter weighs a verify step's cost against a main step's with these: what a verify graph
costs relative to the main graph of the same rows depends on the machine (a weight-streaming
step at one row, a compute-bound one at eight), so it is measured, not assumed. At start-up each
decode graph is replayed a few times (``seed``), so the first steps are weighed on measured
costs too; then the steps as they run take over: their first few of a key are left out
(first-touch page faults, lazy initialisation), after that the median of the key's last few.

A step's time depends on when it runs (attention grows with the context), and a key that stops
running keeps its last time: the two times a ratio compares may come from different moments. So
each key's times count its age, the engine steps (main, verify and mixed; MTP steps run beside
them) since it last ran; a time taken after ``stale`` steps without one starts the key's window
anew, and the engine takes a plain step when the main time is that old (``LLMEngine
._verify_cost_ratio``). Without this, n-gram drafts at eight rows ran at 0.31x plain on chat
prompts (`graphrt bench spec`): after long prompts the main time stood at the long context's
(a moving mean, pulled up further by one step of 1.2 s, a fresh KV cache's first touch), verify
steps ran at every step from then on, each costing 7.6 main steps at the short context, and the
main time was never measured again.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable

from graphrt.runner.graph_key import GraphKey


class StepTimes:
    def __init__(self, skip: int = 2, window: int = 5, stale: int = 32) -> None:
        self.skip, self.window, self.stale = skip, window, stale
        self.seen: dict[GraphKey, int] = {}  # steps recorded a key, warm-up included
        self.recent: dict[GraphKey, deque] = {}  # a key's last ``window`` times
        self.seconds: dict[GraphKey, float] = {}  # a key's time: seeded, then the median of ``recent``
        self.steps = 0  # engine steps recorded
        self.last: dict[GraphKey, int] = {}  # ``steps`` when a key last ran

    def age(self, key: GraphKey) -> int:
        """Engine steps since ``key`` last ran (since start-up, for a key only seeded)."""
        return self.steps - self.last.get(key, 0)

    def is_stale(self, key: GraphKey) -> bool:
        return self.age(key) > self.stale

    def record(self, key: GraphKey, seconds: float) -> None:
        stale = self.is_stale(key)
        if key.kind != "mtp":
            self.steps += 1
        self.last[key] = self.steps
        n = self.seen.get(key, 0) + 1
        self.seen[key] = n
        if n <= self.skip:
            return
        recent = self.recent.setdefault(key, deque(maxlen=self.window))
        if stale:
            recent.clear()
        recent.append(seconds)
        self.seconds[key] = statistics.median(recent)

    def seed(self, graphs: dict[GraphKey, Callable], keys: Iterable[GraphKey], repeats: int = 2) -> None:
        """Each of ``keys`` that has a graph and no time yet: its graph replayed on its buffers
        as they are (padding at start-up: writes land in the null block), once untimed, then the
        fastest of ``repeats``."""
        for key in keys:
            graph = graphs.get(key)
            if graph is None or key in self.seconds:
                continue
            graph()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                graph()
                times.append(time.perf_counter() - start)
            self.seconds[key] = min(times)
            self.last[key] = self.steps

    def ratio(self, key: GraphKey, base: GraphKey) -> float | None:
        """``key``'s time over ``base``'s; None until both are measured."""
        if key not in self.seconds or base not in self.seconds:
            return None
        return self.seconds[key] / self.seconds[base]
