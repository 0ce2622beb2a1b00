"""The one ordered list of graphrt passes, with the reason for each place in it.

``PassManager(backend, disabled)`` runs the enabled passes over a graph in order, keeps a report
of what each matched in which graph, and has a ``uuid()`` over every pass's identity and the
enabled set: anything that changes the rewritten graph changes it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch.fx as fx

from graphrt.passes.base import GraphPass, PassResult
from graphrt.passes.fuse_add_rms_norm import FuseAddRmsNorm
from graphrt.passes.fuse_attention import FuseAttention
from graphrt.passes.fuse_mla_attention import FuseMLAAttention
from graphrt.passes.fuse_sampling import FuseSampling
from graphrt.passes.fuse_slot_mapping import FuseSlotMapping
from graphrt.passes.noop_elimination import NoopElimination
from graphrt.passes.use_skinny_gemm import UseSkinnyGemm

# Projections over at most this many rows go to graphrt's skinny GEMM. Measured with
# `graphrt bench kernels --rows 1,8,16,24,32,48,64` (SmolLM2's shapes, cold weights, fp32): the
# kernel streams the weights at several times aten's speed from 1 to 16 rows and still 1.5-1.6x
# at 24-64 (the verify graphs of speculative decoding hold rows x (k + 1) tokens); prefill-sized
# projections stay with aten's blocked GEMM.
SKINNY_GEMM_MAX_ROWS = 64


@dataclass(frozen=True)
class Entry:
    pass_cls: type[GraphPass]
    reason: str
    backends: tuple[str, ...] | None = None  # None: every backend
    options: tuple[tuple[str, object], ...] = ()


PIPELINE: tuple[Entry, ...] = (
    Entry(
        FuseSlotMapping,
        "first: attention's pattern takes the slot mapping as an input, so the "
        "step's one slot_mapping op must exist before the layers are fused",
    ),
    Entry(
        FuseMLAAttention,
        "latent attention (DeepSeek) with its latent-cache write; after slot mapping, like attention; before "
        "fuse_attention, whose witness counts the einsums left over",
    ),
    Entry(FuseAttention, "the core fusion: cache write + gather + softmax attention per layer"),
    Entry(FuseSampling, "independent of the model body; after attention so the report reads in step order"),
    Entry(
        FuseAddRmsNorm,
        "pays only with a fused add-norm kernel (NPU); Inductor fuses the chain itself, where the op would be slower",
        backends=("torchair", "eager"),
    ),
    Entry(
        UseSkinnyGemm,
        f"kernel choice per projection: at most {SKINNY_GEMM_MAX_ROWS} rows is a weight stream (decode, the LM head's "
        "few logits rows), more is a GEMM aten does best; after sampling, whose pattern starts at the LM head's aten "
        "linear; CPU backends only (an NPU has its own matmul)",
        backends=("inductor", "eager"),
        options=(("max_rows", SKINNY_GEMM_MAX_ROWS),),
    ),
    Entry(
        NoopElimination, "last: the fusion patterns are traced from source that spells these casts and must see them"
    ),
)
PASS_NAMES = tuple(e.pass_cls.name for e in PIPELINE)


@dataclass
class PassReport:
    """graph name → pass name → result."""

    graphs: dict[str, dict[str, PassResult]] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = []
        for graph, passes in self.graphs.items():
            parts = [
                f"{name}={r.matched}" + (f" (unmatched {r.unmatched})" if r.unmatched else "")
                for name, r in passes.items()
            ]
            out.append(f"{graph}: " + ", ".join(parts))
        return out

    def matched(self, graph: str, name: str) -> int:
        return self.graphs[graph][name].matched


class PassManager:
    def __init__(self, backend: str = "inductor", disabled: tuple[str, ...] | list[str] = ()) -> None:
        unknown = sorted(set(disabled) - set(PASS_NAMES))
        if unknown:
            raise ValueError(f"unknown pass name(s) {unknown} in passes_disabled; passes: {list(PASS_NAMES)}")
        self.backend = backend
        self.disabled = tuple(sorted(set(disabled)))
        self.passes: list[GraphPass] = [
            e.pass_cls(**dict(e.options))
            for e in PIPELINE
            if e.pass_cls.name not in self.disabled and (e.backends is None or backend in e.backends)
        ]
        self.report = PassReport()

    def __call__(self, graph: fx.Graph, graph_name: str = "graph") -> dict[str, PassResult]:
        results = {}
        for p in self.passes:
            results[p.name] = p(graph)
        graph.lint()
        self.report.graphs[graph_name] = results
        return results

    def uuid(self) -> str:
        h = hashlib.sha256(self.backend.encode())
        for p in self.passes:
            h.update(p.name.encode())
            h.update(p.uuid().encode())
        return h.hexdigest()
