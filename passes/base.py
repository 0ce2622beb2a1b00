"""The shape every graphrt pass has: ``__call__(graph)``, ``uuid()``, a count of what it did."""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.fx as fx
from torch.fx import Node

from graphrt.kernels import canonical
from graphrt.passes.matcher import Match, Pattern, find_match, insertion_point, replace_match

log = logging.getLogger("graphrt.passes")


@dataclass
class PassResult:
    matched: int = 0
    unmatched: int = 0  # candidates the pass saw but could not rewrite (see the pass's witness)
    notes: list[str] = field(default_factory=list)


class GraphPass:
    """A rewrite of a torch-level FX graph, in place."""

    name = "pass"

    def __init__(self, **options) -> None:
        self.options = options

    def __call__(self, graph: fx.Graph) -> PassResult:
        raise NotImplementedError

    def sources(self) -> list[str]:
        """Source files whose edits must change this pass's identity."""
        return [inspect.getsourcefile(type(self))]

    def uuid(self) -> str:
        h = hashlib.sha256(self.name.encode())
        for path in self.sources():
            with open(path, "rb") as f:
                h.update(f.read())
        h.update(repr(sorted(self.options.items())).encode())
        return h.hexdigest()


class FusionPass(GraphPass):
    """Find every exact match of its canonical functions (one per accepted spelling) and replace
    each with one fused op."""

    pattern_fns: tuple[Callable, ...]
    witness: Callable[[Node], bool] = staticmethod(lambda n: False)  # unfused leftovers to report

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.patterns = [Pattern(fn) for fn in self.pattern_fns]

    def sources(self) -> list[str]:
        # The pattern is traced from kernels/canonical.py: editing it changes what matches.
        return [*super().sources(), inspect.getsourcefile(canonical), sys.modules[__name__].__file__]

    def accept(self, m: Match) -> bool:
        return True

    def rewrite(self, graph: fx.Graph, m: Match) -> list[Node]:
        """Insert the fused op (the graph's inserting point is set) and return its outputs in the
        order of the pattern's outputs."""
        raise NotImplementedError

    def __call__(self, graph: fx.Graph) -> PassResult:
        result = PassResult()
        for pattern in self.patterns:
            while (m := find_match(pattern, graph, self.accept)) is not None:
                with graph.inserting_before(insertion_point(graph, m)):
                    new = self.rewrite(graph, m)
                replace_match(graph, m, new)
                result.matched += 1
        result.unmatched = sum(1 for n in graph.nodes if self.witness(n))
        log.debug("%s: %d rewritten, %d left", self.name, result.matched, result.unmatched)
        return result
