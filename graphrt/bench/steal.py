"""CPU time the hypervisor gave to other guests while a measurement ran: its "steal".

On a shared virtual machine a vCPU is now and then not running at all: Linux counts that time as
steal in ``/proc/stat``. A decode step then takes longer for no reason the engine can see, so
every benchmark row records the share of CPU time stolen while it ran (``steal_frac``): on the
2-core AMD EPYC of the README's latest numbers it was about 1% at rest and 27% during one run of a
quantized-kernel probe, which read 25-35% slower than the same probe minutes later at 1%. A number taken
under steal is a number about the neighbours; compare rows whose steal is low.
"""

from __future__ import annotations

import time

PROC_STAT = "/proc/stat"


def cpu_times(path: str = PROC_STAT) -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs together since boot, or None where the kernel does
    not report steal (not Linux, or a kernel older than 2.6.11)."""
    try:
        with open(path) as f:
            first = f.readline().split()
    except OSError:
        return None
    if len(first) < 9 or first[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already
    # inside user and nice, so the total stops at steal
    ticks = [int(v) for v in first[1:9]]
    return ticks[7], sum(ticks)


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Stolen ticks over all ticks between two ``cpu_times`` readings; None without both readings
    or when no tick passed between them."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


class StealMeter:
    """``with StealMeter() as m: ...``, then ``m.fraction``: the steal over the block. The kernel
    updates its counters every tick (1-10 ms), so a block shorter than a few ticks reads None or a
    coarse value; ``seconds`` is the block's wall time."""

    def __init__(self, path: str = PROC_STAT) -> None:
        self.path = path
        self.fraction: float | None = None
        self.seconds = 0.0

    def __enter__(self) -> StealMeter:
        self._before = cpu_times(self.path)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start
        self.fraction = steal_fraction(self._before, cpu_times(self.path))


def steal_note(fraction: float | None) -> str:
    """The text a benchmark line ends with: "" below 1% (or unknown), else "  steal 12%"."""
    return "" if fraction is None or fraction < 0.01 else f"  steal {100 * fraction:.0f}%"
