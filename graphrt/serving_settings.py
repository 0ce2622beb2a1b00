"""ServingSettings: the engine settings that shape compiled graphs, and what a shipped graph
cache does with them.

``graphrt precompile`` records them in the cache's manifest. An engine started from that cache
adopts every setting it was not given; a setting it was given that changes the graphs is an error
that names the setting, both values and the number of graphs that would have to be built
(``rebuild_graph_cache=True`` builds them knowingly). The KV cache size and max_model_len do not
shape graphs (packages leave those sizes free), so they never conflict: the recorded KV size is
only the default.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from graphrt.runner.graph_cache import CaptureSizes, GraphCache

DEFAULTS = {
    "dtype": "float32",
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "block_size": 16,
    "kv_cache_dtype": "auto",
}
# What changes a graph's code or its input shapes; the rest is served by the same graphs.
SHAPING = (
    "model",
    "dtype",
    "block_size",
    "max_num_seqs",
    "capture_sizes",
    "passes_disabled",
    "grammar_backend",
    "speculative_tokens",
    "speculative_method",
    "kv_cache_dtype",
)


class GraphCacheMismatchError(ValueError):
    """The settings asked for differ from those a shipped graph cache was built with."""


def model_identity(config_dict: dict) -> str:
    """The architecture a graph cache was built for (weights are graph inputs, not part of it)."""
    return hashlib.sha256(json.dumps(config_dict, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ServingSettings:
    model: str
    dtype: str
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    capture_sizes: CaptureSizes
    kv_num_blocks: int | None
    passes_disabled: tuple[str, ...]
    grammar_backend: str
    speculative_tokens: int = 0  # draft slots a verify graph holds; 0: no verify graphs
    speculative_method: str = ""  # "ngram", "mtp" (MTP graphs, main graphs that return hidden states)
    kv_cache_dtype: str = "auto"  # "auto": auto_kv_dtype's (runner/kv_cache.py); else the caches' dtype

    def to_dict(self) -> dict:
        d = asdict(self)
        d["capture_sizes"] = {"decode": list(self.capture_sizes.decode), "mixed": list(self.capture_sizes.mixed)}
        d["passes_disabled"] = sorted(self.passes_disabled)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ServingSettings:
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        sizes = d.get("capture_sizes") or {"decode": [], "mixed": []}
        d["capture_sizes"] = CaptureSizes(decode=tuple(sizes["decode"]), mixed=tuple(sizes["mixed"]))
        d["passes_disabled"] = tuple(d.get("passes_disabled", ()))
        return cls(**d)

    def show(self, name: str) -> str:
        value = getattr(self, name)
        if isinstance(value, CaptureSizes):
            return f"decode={list(value.decode)} mixed={list(value.mixed)}"
        return repr(list(value) if isinstance(value, tuple) else value)


def adopt(given, shipped: ServingSettings | None, name: str):
    """A setting's value: as given, else as shipped, else the default."""
    if given is not None:
        return given
    if shipped is not None:
        return getattr(shipped, name)
    return DEFAULTS[name]


def differences(wanted: ServingSettings, shipped: ServingSettings) -> list[str]:
    """'setting: asked X, the graph cache was built with Y' for each setting that shapes graphs."""
    return [
        f"{name}: asked {wanted.show(name)}, the graph cache was built with {shipped.show(name)}"
        for name in SHAPING
        if getattr(wanted, name) != getattr(shipped, name)
    ]


def graphs_to_build(diffs: list[str], wanted_keys: list, shipped: ServingSettings) -> int:
    """How many of the wanted graphs a cache built with ``shipped`` lacks: all of them when a
    setting that changes code differs, else those of other sizes or row counts."""
    changes_code = {
        "model",
        "dtype",
        "block_size",
        "passes_disabled",
        "grammar_backend",
        "speculative_method",
        "kv_cache_dtype",
    }
    if any(d.split(":")[0] in changes_code for d in diffs):
        return len(wanted_keys)
    built = GraphCache(shipped.capture_sizes, shipped.max_num_seqs, 1, 1, shipped.speculative_tokens).all_keys()
    return len(set(wanted_keys) - set(built))


def mismatch_message(root: str, diffs: list[str], missing: int) -> str:
    lines = "\n  ".join(diffs)
    return (
        f"graph cache {root} was built with other settings:\n  {lines}\n"
        f"{missing} graph(s) would have to be built (minutes each on a small CPU). Leave these settings "
        f"unset to use the cache's, or pass rebuild_graph_cache=True (--rebuild-graph-cache) to build them."
    )
