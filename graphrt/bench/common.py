"""What every benchmark prints and shares: machine facts, timers, statistics."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name where the kernel reports one ("AMD EPYC", "Intel(R) Xeon(R) ..."), else
    the machine's architecture: two hosts of one cloud type can be different CPUs."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts(dtype: str) -> dict:
    from graphrt.kernels import NATIVE_ISA, NATIVE_PACKS_BF16, packed_bf16, quant_tiles

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": dtype,
        "native_isa": NATIVE_ISA,
        "quantized_layout": "tiles" if quant_tiles.wanted(NATIVE_ISA) else "plain",
        "bf16_layout": "packed" if packed_bf16.wanted(NATIVE_PACKS_BF16) else "row-major",
    }


def print_facts(facts: dict) -> None:
    print("machine: " + ", ".join(f"{k}={v}" for k, v in facts.items()))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def p90(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


def write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {path}")


class Clock:
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt
