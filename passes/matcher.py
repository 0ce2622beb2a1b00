"""Exact subgraph matching of a traced canonical function inside a Dynamo graph.

A pattern is a canonical function (``graphrt.kernels.canonical``) traced with
``torch.fx.symbolic_trace``: the same torch-level spelling Dynamo records for a model that calls
that function. Matching is exact, so a pass fires only on what it claims:

* every call must have the same op, target, argument structure and literal arguments;
* a pattern input binds one graph value (a node or a literal, e.g. the attention scale) and must
  bind the same one at every use;
* shape arithmetic in the pattern (``q.shape[0]``, ``num_heads // num_kv_heads``, ``x.device``)
  is evaluated on the shapes of the bound tensors and must equal the graph's literal: Dynamo bakes
  static shapes into the graph, the pattern keeps the formula, and the formula is checked;
* side-effecting calls (the in-place cache write) are found through the values they use, and the
  tensor they write may have other users only before or after the match (a cache written by
  several matches in sequence, as an MTP layer's chained drafts do, keeps its order);
* no matched intermediate may be used outside the match, except the pattern's outputs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx import Node

_META_ATTRS = ("shape", "device", "dtype")
_META_OPS = {
    operator.getitem,
    operator.mul,
    operator.add,
    operator.sub,
    operator.floordiv,
    operator.neg,
    operator.mod,
}


def example_value(node: Node) -> Any:
    meta = node.meta
    return meta["example_value"] if "example_value" in meta else meta.get("val")


class Pattern:
    """A canonical function, traced once."""

    def __init__(self, fn: Callable, name: str | None = None) -> None:
        self.name = name or fn.__name__
        self.graph = fx.symbolic_trace(fn).graph
        self.nodes = list(self.graph.nodes)
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        out = next(n for n in self.nodes if n.op == "output").args[0]
        self.outputs: list[Node] = list(out) if isinstance(out, (tuple, list)) else [out]
        self.meta_nodes = self._find_meta_nodes()
        self.compute = [n for n in self.nodes if n.op in ("call_function", "call_method") and n not in self.meta_nodes]

    def _find_meta_nodes(self) -> set[Node]:
        meta: set[Node] = set()
        for n in self.nodes:
            if n.op == "call_function" and n.target is getattr and n.args[1] in _META_ATTRS:
                meta.add(n)
            elif n.op == "call_function" and n.target in _META_OPS:
                node_args = [a for a in n.args if isinstance(a, Node)]
                if node_args and all(a in meta for a in node_args):
                    meta.add(n)
        return meta


@dataclass
class Match:
    pattern: Pattern
    bindings: dict[Node, Any]  # pattern node → graph node or literal
    nodes: list[Node] = field(default_factory=list)  # matched graph nodes, in graph order

    def __getitem__(self, name: str) -> Any:
        """The graph value bound to the pattern input ``name``."""
        for p in self.pattern.placeholders:
            if p.target == name:
                return self.bindings[p]
        raise KeyError(name)

    @property
    def outputs(self) -> list[Node]:
        return [self.bindings[o] for o in self.pattern.outputs]


class _Attempt:
    def __init__(self, pattern: Pattern) -> None:
        self.p = pattern
        self.bind: dict[Node, Any] = {}
        self.taken: dict[Node, Node] = {}  # graph node → pattern node (injective on nodes)
        self.deferred: list[tuple[Node, Any]] = []

    def copy(self) -> _Attempt:
        a = _Attempt(self.p)
        a.bind, a.taken, a.deferred = dict(self.bind), dict(self.taken), list(self.deferred)
        return a

    def node(self, p: Node, t: Any) -> bool:
        if p in self.bind:
            b = self.bind[p]
            return b is t if isinstance(b, Node) or isinstance(t, Node) else _same_literal(b, t)
        if p.op == "placeholder":
            if isinstance(t, Node) and t in self.taken:
                return False
            self.bind[p] = t
            if isinstance(t, Node):
                self.taken[t] = p
            return True
        if p in self.p.meta_nodes:
            if isinstance(t, Node):
                return False
            self.bind[p] = t
            self.deferred.append((p, t))
            return True
        if not isinstance(t, Node) or t in self.taken or t.op != p.op or t.target != p.target:
            return False
        if len(t.args) != len(p.args) or set(t.kwargs) != set(p.kwargs):
            return False
        self.bind[p] = t
        self.taken[t] = p
        return all(self.arg(pa, ta) for pa, ta in zip(p.args, t.args)) and all(
            self.arg(p.kwargs[k], t.kwargs[k]) for k in p.kwargs
        )

    def arg(self, pa: Any, ta: Any) -> bool:
        if isinstance(pa, Node):
            return self.node(pa, ta)
        if isinstance(pa, (tuple, list)):
            return isinstance(ta, (tuple, list)) and len(pa) == len(ta) and all(self.arg(x, y) for x, y in zip(pa, ta))
        if isinstance(pa, slice):
            return isinstance(ta, slice) and all(
                self.arg(getattr(pa, f), getattr(ta, f)) for f in ("start", "stop", "step")
            )
        return not isinstance(ta, Node) and _same_literal(pa, ta)

    def eval_meta(self, p: Any) -> Any:
        if not isinstance(p, Node):
            return p
        if p.op == "placeholder":
            b = self.bind[p]
            return example_value(b) if isinstance(b, Node) else b
        if p not in self.p.meta_nodes:
            b = self.bind.get(p)
            if not isinstance(b, Node):
                raise LookupError(p)
            return example_value(b)
        args = [self.eval_meta(a) if isinstance(a, Node) else a for a in p.args]
        if p.target is getattr:
            return getattr(args[0], args[1])
        return p.target(*args)


def _same_literal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return type(a) is type(b) and a == b


def find_match(pattern: Pattern, graph: fx.Graph, accept: Callable[[Match], bool] | None = None) -> Match | None:
    """The first exact match of the pattern in the graph (anchored on its first output)."""
    anchor = pattern.outputs[0]
    for t in graph.nodes:
        if t.op != anchor.op or t.target != anchor.target:
            continue
        m = _match_at(pattern, graph, anchor, t)
        if m is not None and (accept is None or accept(m)):
            return m
    return None


def _match_at(pattern: Pattern, graph: fx.Graph, anchor: Node, t: Node) -> Match | None:
    a = _Attempt(pattern)
    if not a.node(anchor, t):
        return None
    a = _grow(a)
    if a is None:
        return None
    # Shape formulas against the bound tensors' real shapes.
    try:
        if any(not _same_literal(a.eval_meta(p), lit) for p, lit in a.deferred):
            return None
    except (LookupError, AttributeError, TypeError, IndexError):
        return None
    if any(p not in a.bind for p in pattern.placeholders if p.users):
        return None
    matched = {t for t, p in a.taken.items() if p.op != "placeholder"}
    outputs = {a.bind[o] for o in pattern.outputs}
    for t in matched:
        if t not in outputs and any(u not in matched for u in t.users):
            return None  # an intermediate escapes: rewriting would break its other user
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, last = min(order[t] for t in matched), max(order[t] for t in matched)
    for t in matched:  # a tensor written in place must not be used inside the match's span by others
        if t.op == "call_method" and str(t.target).endswith("_"):
            base = t.args[0]
            while isinstance(base, Node) and base in matched:
                base = base.args[0]
            if isinstance(base, Node) and any(u not in matched and first < order[u] < last for u in base.users):
                return None
    return Match(pattern, a.bind, sorted(matched, key=order.__getitem__))


def _grow(a: _Attempt) -> _Attempt | None:
    """Bind the pattern nodes the outputs do not reach (other outputs, in-place writes) through the
    users of values already bound; backtrack over candidates."""
    pending = [p for p in a.p.compute if p not in a.bind]
    if not pending:
        return a
    for p in pending:
        for pa in p.all_input_nodes:
            b = a.bind.get(pa)
            if not isinstance(b, Node) or pa in a.p.meta_nodes:
                continue
            for user in b.users:
                if user in a.taken:
                    continue
                trial = a.copy()
                if trial.node(p, user):
                    done = _grow(trial)
                    if done is not None:
                        return done
            return None  # the first bound input's users hold no match: nothing else can
    return None


def insertion_point(graph: fx.Graph, m: Match) -> Node:
    """The earliest output of the match: every input of the pattern is defined before it."""
    outs = set(m.outputs)
    return next(n for n in graph.nodes if n in outs)


def set_fake_meta(node: Node, fn: Callable, *args: Any) -> None:
    """Give a new node the example value Dynamo gives its nodes (fake tensors from its inputs)."""
    fake_args = [example_value(a) if isinstance(a, Node) else a for a in args]
    leaves = pytree.tree_leaves(fake_args)
    mode = next((v.fake_mode for v in leaves if hasattr(v, "fake_mode")), None)
    if mode is None:
        return
    with mode:
        node.meta["example_value"] = fn(*fake_args)


def emit(graph: fx.Graph, op, args: tuple, num_outputs: int = 0) -> list[Node]:
    """Insert ``op(*args)`` (with example values) at the graph's insertion point; returns
    ``[node]``, or its ``num_outputs`` getitem nodes when the op returns a tuple."""
    node = graph.call_function(op, args)
    set_fake_meta(node, op, *args)
    if not num_outputs:
        return [node]
    outs = []
    for i in range(num_outputs):
        out = graph.call_function(operator.getitem, (node, i))
        set_fake_meta(out, lambda t, i=i: t[i], node)
        outs.append(out)
    return outs


def replace_match(graph: fx.Graph, m: Match, new_outputs: list[Node]) -> None:
    """Point every user of the match's outputs at the new nodes, then erase the match."""
    for old, new in zip(m.outputs, new_outputs):
        old.replace_all_uses_with(new)
    for n in reversed(m.nodes):
        graph.erase_node(n)
