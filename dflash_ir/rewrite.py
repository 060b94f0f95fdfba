"""Pattern rewriting: the one mechanism every optimisation pass is written in.

A pattern (`P`, `V`) describes a value by how it was computed: the producing op (or set of
ops), predicates on its attributes, its dtype, and patterns for the node's inputs, with
named captures (a name used twice must bind the same value). A `Rule` pairs a root pattern
with a function `fn(match, emit)` that builds replacement nodes through `emit.op(...)`
(output types inferred by the op registry, as `GraphBuilder.op` does) and returns the
value replacing the matched root, or a mapping old value -> new value, or None to decline.

`rewrite(graph, rules, name=...)` applies the rules to a fixpoint, top-down in schedule
order, then returns a new verified graph: consumers, graph outputs and state updates are
rewired, dead nodes removed, identical new nodes shared (hash-consing, as tinygrad does),
and a replacement takes over the name of the value it replaced, so outputs, state updates
and meta entries that name values keep working.

    rule = Rule("swiglu", P("mul", P("silu", V("a"), one_use=True), V("b"), commutative=True),
                lambda m, emit: emit.op("swiglu", m["a"], m["b"]))
    graph = rewrite(graph, [rule], name="fuse_elementwise")
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

from .dtypes import DType
from .ir import Graph, Node, State, Value, freeze_attr
from .ops.registry import get_op
from .verifier import VerifyError, verify

MAX_SWEEPS = 64


class RewriteError(RuntimeError):
    """A rule produced something invalid (wrong type, cycle) or the rules never settle."""


@dataclass(frozen=True)
class Pat:
    """Matches a value. Build with `P` (computed by an op) and `V` (any value)."""

    ops: frozenset[str] | None = None
    inputs: tuple["Pat", ...] | None = None
    name: str | None = None
    attrs: tuple[tuple[str, Any], ...] = ()
    dtypes: frozenset[DType] | None = None
    kind: str | None = None
    output: int | None = None
    one_use: bool = False
    commutative: bool = False
    alternatives: tuple["Pat", ...] = ()

    def __or__(self, other: "Pat") -> "Pat":
        return Pat(alternatives=(*(self.alternatives or (self,)), *(other.alternatives or (other,))))


KINDS = ("input", "weight", "state", "node")


def P(op: str | Iterable[str], *inputs: Pat, name: str | None = None, attrs: Mapping[str, Any] | None = None,
      dtype: DType | Iterable[DType] | None = None, output: int | None = 0, one_use: bool = False,
      commutative: bool = False) -> Pat:
    """A value computed by `op` (a name or a set of names) from values matching `inputs`
    (omitted: any inputs). `attrs` values are exact or predicates; `output` is which output
    of a multi-output node (None: any); `one_use`: consumed by exactly one node and neither a
    graph output nor a state update; `commutative`: the two inputs may match either way round."""
    ops = frozenset([op] if isinstance(op, str) else op)
    return Pat(ops, tuple(inputs) if inputs else None, name, tuple((attrs or {}).items()), _dtypes(dtype),
               "node", output, one_use, commutative)


def V(name: str | None = None, *, dtype: DType | Iterable[DType] | None = None, kind: str | None = None,
      one_use: bool = False) -> Pat:
    """Any value (optionally only a graph input, weight, state or node output: `kind`)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return Pat(name=name, dtypes=_dtypes(dtype), kind=kind, one_use=one_use)


def _dtypes(dtype) -> frozenset | None:
    if dtype is None:
        return None
    return frozenset(dtype) if isinstance(dtype, (list, tuple, set, frozenset)) else frozenset([dtype])


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Pat
    fn: Callable[["Match", "Emitter"], Any]


class Match:
    """Captured values by name; `node(name)` is the node that computed a captured value."""

    def __init__(self, work: "_Work", root: Node, root_value: Value, captures: Mapping[str, str]):
        self._work = work
        self.root = root
        self.value = root_value
        self._captures = dict(captures)

    def __getitem__(self, name: str) -> Value:
        return self._work.values[self._captures[name]]

    def node(self, name: str) -> Node:
        return self.producer(self[name])

    def producer(self, value: Value) -> Node:
        return self._work.nodes[self._work.producer[value.name]]


class Emitter:
    """What a rule may do besides reading its match: make nodes and ask about the graph."""

    def __init__(self, work: "_Work", hint: str, order: float):
        self._work = work
        self._hint = hint
        self._order = order
        self.created: list[int] = []

    @property
    def meta(self) -> dict[str, Any]:
        return self._work.meta

    def op(self, opname: str, *inputs: Value, name: str | None = None, **attrs: Any):
        """Add a node (or reuse an identical one); returns its Value, or a tuple of them."""
        outs, new = self._work.add_node(opname, inputs, attrs, name or f"{self._hint}.{opname}",
                                        self._order + (len(self.created) + 1) * 1e-6)
        if new is not None:
            self.created.append(new)
        return outs[0] if len(outs) == 1 else outs

    def uses(self, value: Value) -> int:
        """How many nodes consume `value`, plus one if it is a graph output or a state update."""
        return len(self._work.users.get(value.name, ())) + self._work.external(value.name)

    def readers(self, value: Value) -> list[Node]:
        """The nodes consuming `value`, in schedule order."""
        return [self._work.nodes[nid] for nid in sorted(self._work.users.get(value.name, ()),
                                                         key=self._work.order.__getitem__)]

    def value(self, name: str) -> Value:
        return self._work.values[name]

    def kind(self, value: Value) -> str:
        """"input", "weight", "state" or "node"."""
        return self._work.kind[value.name]

    def twin(self, node: Node) -> tuple[Value, ...] | None:
        """Outputs of another live node with the same op, inputs and attrs, if there is one."""
        nid = self._work.keys.get(_key(node))
        if nid is None or nid not in self._work.nodes or self._work.nodes[nid] == node:
            return None
        return self._work.nodes[nid].outputs


def _key(node: Node) -> tuple:
    return node.op, node.inputs, node.attrs


class _Work:
    """A mutable copy of a graph, indexed for matching and rewiring."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.meta = dict(graph.meta)
        self.values: dict[str, Value] = {}
        self.kind: dict[str, str] = {}
        for kind, vals in (("input", graph.inputs), ("weight", [w.value for w in graph.weights]),
                           ("state", [s.value for s in graph.states])):
            for v in vals:
                self.values[v.name], self.kind[v.name] = v, kind
        self.nodes: dict[int, Node] = {}
        self.order: dict[int, float] = {}
        self.producer: dict[str, int] = {}
        self.users: dict[str, set[int]] = {}
        self.keys: dict[tuple, int] = {}
        self.outputs = list(graph.outputs)
        self.updates = {s.value.name: s.update for s in graph.states}
        self._next = 0
        for i, n in enumerate(graph.nodes):
            self._insert(n, float(i))

    # -- indexing -------------------------------------------------------------------------
    def _insert(self, node: Node, order: float) -> int:
        nid = self._next
        self._next += 1
        self.nodes[nid], self.order[nid] = node, order
        for v in node.outputs:
            self.values[v.name], self.kind[v.name], self.producer[v.name] = v, "node", nid
        for i in node.inputs:
            self.users.setdefault(i, set()).add(nid)
        self.keys.setdefault(_key(node), nid)
        return nid

    def _set(self, nid: int, node: Node) -> None:
        """Replace node `nid` in place (same outputs' meaning, new inputs or names)."""
        old = self.nodes[nid]
        if self.keys.get(_key(old)) == nid:
            del self.keys[_key(old)]
        for i in old.inputs:
            self.users[i].discard(nid)
        for v in old.outputs:
            del self.producer[v.name]
        self.nodes[nid] = node
        for v in node.outputs:
            self.values[v.name], self.kind[v.name], self.producer[v.name] = v, "node", nid
        for i in node.inputs:
            self.users.setdefault(i, set()).add(nid)
        self.keys.setdefault(_key(node), nid)

    # -- MatchView ------------------------------------------------------------------------
    def kind_of(self, name: str) -> str | None:
        return self.kind.get(name)

    def dtype_of(self, name: str) -> DType:
        return self.values[name].type.dtype

    def single_use(self, name: str) -> bool:
        return len(self.users.get(name, ())) == 1 and not self.external(name)

    def producer_of(self, name: str) -> tuple[str, tuple, Mapping[str, Any], int] | None:
        if name not in self.producer:
            return None
        node = self.nodes[self.producer[name]]
        return node.op, node.inputs, node.attr, next(i for i, v in enumerate(node.outputs) if v.name == name)

    def external(self, name: str) -> int:
        return int(any(v == name for _, v in self.outputs) or name in self.updates.values())

    def fresh(self, hint: str) -> str:
        name, n = hint, 0
        while name in self.values:
            n += 1
            name = f"{hint}_{n}"
        return name

    # -- editing --------------------------------------------------------------------------
    def add_node(self, opname: str, inputs: tuple[Value, ...], attrs: Mapping[str, Any], hint: str, order: float):
        attrs = {k: freeze_attr(v) for k, v in attrs.items()}
        names = tuple(v.name for v in inputs)
        probe = Node.make(opname, names, (), attrs)
        if (nid := self.keys.get(_key(probe))) is not None and nid in self.nodes:
            return self.nodes[nid].outputs, None
        types = get_op(opname).output_types([v.type for v in inputs], attrs)
        outs = []
        for i, t in enumerate(types):
            outs.append(Value(self.fresh(hint if len(types) == 1 else f"{hint}.{i}"), t))
            self.values[outs[-1].name] = outs[-1]  # reserve the name
        return tuple(outs), self._insert(Node(opname, names, tuple(outs), probe.attrs), order)

    def replace_uses(self, old: str, new: str, keep: Iterable[int] = ()) -> None:
        """Point every reader of `old` but the nodes in `keep` at `new`."""
        for nid in sorted(self.users.get(old, set()) - set(keep)):
            n = self.nodes[nid]
            self._set(nid, replace(n, inputs=tuple(new if i == old else i for i in n.inputs)))
        if not self.users.get(old):
            self.users.pop(old, None)
        self.outputs = [(o, new if v == old else v) for o, v in self.outputs]
        self.updates = {s: new if u == old else u for s, u in self.updates.items()}

    def live(self, nid: int) -> bool:
        return any(self.users.get(v.name) or self.external(v.name) for v in self.nodes[nid].outputs)

    def remove_dead(self, candidates: Iterable[int]) -> None:
        work = [n for n in candidates if n in self.nodes]
        while work:
            nid = work.pop()
            if nid not in self.nodes or self.live(nid):
                continue
            node = self.nodes.pop(nid)
            del self.order[nid]
            if self.keys.get(_key(node)) == nid:
                del self.keys[_key(node)]
            for v in node.outputs:
                del self.producer[v.name], self.values[v.name], self.kind[v.name]
                self.users.pop(v.name, None)
            for i in node.inputs:
                self.users[i].discard(nid)
                if i in self.producer:
                    work.append(self.producer[i])

    def rename(self, value: str, name: str) -> None:
        """Give node output `value` the (now unused) name `name`."""
        nid = self.producer[value]
        n = self.nodes[nid]
        v = self.values.pop(value)
        del self.kind[value]
        self._set(nid, replace(n, outputs=tuple(Value(name, v.type) if o.name == value else o for o in n.outputs)))
        self.replace_uses(value, name)

    # -- result ---------------------------------------------------------------------------
    def schedule(self) -> list[Node]:
        """Topological order, preferring each node's order hint (the original schedule)."""
        waiting = {nid: sum(1 for i in set(n.inputs) if i in self.producer) for nid, n in self.nodes.items()}
        ready = [(self.order[nid], nid) for nid, c in waiting.items() if c == 0]
        heapq.heapify(ready)
        out: list[Node] = []
        while ready:
            _, nid = heapq.heappop(ready)
            out.append(self.nodes[nid])
            for v in self.nodes[nid].outputs:
                for user in self.users.get(v.name, ()):
                    waiting[user] -= 1
                    if waiting[user] == 0:
                        heapq.heappush(ready, (self.order[user], user))
        if len(out) != len(self.nodes):
            raise RewriteError(f"graph {self.graph.name!r}: the rewritten graph has a cycle")
        return out

    def to_graph(self) -> Graph:
        g = self.graph
        used = {v for _, v in self.outputs} | {v for v, users in self.users.items() if users}
        return replace(g, weights=tuple(w for w in g.weights if w.value.name in used),
                       states=tuple(State(s.value, self.updates[s.value.name]) for s in g.states),
                       nodes=tuple(self.schedule()), outputs=tuple(self.outputs), meta=tuple(sorted(self.meta.items())))


# -- matching -----------------------------------------------------------------------------
class MatchView(Protocol):
    """What the matcher asks of the structure it matches in (a graph here; kernel trees in
    backends/kir/simplify.py): values are opaque handles."""

    def kind_of(self, value) -> str | None: ...
    def dtype_of(self, value) -> Any: ...
    def single_use(self, value) -> bool: ...
    def producer_of(self, value) -> tuple[str, tuple, Mapping[str, Any], int] | None:
        """(op, inputs, attrs, which output `value` is) of the node computing it, or None."""


def match(view: MatchView, pat: Pat, value, caps: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every way `value` matches `pat` given the captures so far (a generator: backtracking)."""
    caps = dict(caps or {})
    if pat.alternatives:
        for alt in pat.alternatives:
            yield from match(view, alt, value, caps)
        return
    if pat.name is not None and pat.name in caps and caps[pat.name] != value:
        return
    if pat.kind is not None and view.kind_of(value) != pat.kind:
        return
    if pat.dtypes is not None and view.dtype_of(value) not in pat.dtypes:
        return
    if pat.one_use and not view.single_use(value):
        return
    caps = {**caps, pat.name: value} if pat.name is not None else caps
    if pat.ops is None:
        yield caps
        return
    made = view.producer_of(value)
    if made is None:
        return
    op, inputs, attrs, index = made
    if op not in pat.ops or (pat.output is not None and pat.output != index):
        return
    for key, want in pat.attrs:
        have = attrs.get(key)
        if not (want(have) if callable(want) else have == freeze_attr(want)):
            return
    if pat.inputs is None:
        yield caps
        return
    if len(pat.inputs) != len(inputs):
        return
    orders = [tuple(inputs)]
    if pat.commutative and len(inputs) == 2:
        orders.append(tuple(inputs)[::-1])
    for names in orders:
        yield from _match_all(view, pat.inputs, names, caps)


def _match_all(view: MatchView, pats, values, caps) -> Iterator[dict[str, Any]]:
    if not pats:
        yield caps
        return
    for c in match(view, pats[0], values[0], caps):
        yield from _match_all(view, pats[1:], values[1:], c)


def _root_ops(rules: list[Rule]) -> dict[str | None, list[Rule]]:
    index: dict[str | None, list[Rule]] = {}
    for r in rules:
        roots = r.pattern.alternatives or (r.pattern,)
        for op in {op for p in roots for op in (p.ops or (None,))}:
            index.setdefault(op, []).append(r)
    return index


def _apply(work: _Work, rule: Rule, nid: int) -> bool:
    node = work.nodes[nid]
    for out in node.outputs:
        for caps in match(work, rule.pattern, out.name):
            emit = Emitter(work, out.name, work.order[nid] - 1)
            result = rule.fn(Match(work, node, out, caps), emit)
            if result is not None and _substitute(work, rule, out, result, emit):
                return True
            work.remove_dead(emit.created)
    return False


def _substitute(work: _Work, rule: Rule, root: Value, result, emit: Emitter) -> bool:
    pairs = result.items() if isinstance(result, Mapping) else [(root, result)]
    mapping = [(work.values[k] if isinstance(k, str) else k, new) for k, new in pairs]
    mapping = [(old, new) for old, new in mapping if old.name != new.name]
    if not mapping:
        return False
    for old, new in mapping:
        if old.type != new.type:
            raise RewriteError(f"rule {rule.name!r}: replaces %{old.name}: {old.type} with %{new.name}: {new.type}")
        if old.name in work.updates.values() and (work.kind[new.name] != "node" or new.name in work.updates.values()):
            return False  # a state update must stay a distinct computed value
    created = {v.name for nid in emit.created for v in work.nodes[nid].outputs}
    olds = {work.producer[old.name] for old, _ in mapping if old.name in work.producer}
    for old, new in mapping:
        work.replace_uses(old.name, new.name, keep=emit.created)
    work.remove_dead(olds)
    for old, new in mapping:
        if new.name in created and old.name not in work.values:
            work.rename(new.name, old.name)
    return True


def rewrite(graph: Graph, rules: Iterable[Rule], *, name: str) -> Graph:
    """Apply `rules` until none matches; dead nodes go. Returns a new, verified graph."""
    rules = list(rules)
    index = _root_ops(rules)
    work = _Work(graph)
    n_nodes = len(work.nodes)
    work.remove_dead(list(work.nodes))
    changed = len(work.nodes) != n_nodes
    for _ in range(MAX_SWEEPS):
        fired = False
        for nid in sorted(work.nodes, key=work.order.__getitem__):
            if nid not in work.nodes:
                continue
            for rule in index.get(work.nodes[nid].op, []) + index.get(None, []):
                if _apply(work, rule, nid):
                    fired = True
                    break
        if not fired:
            break
        changed = True
    else:
        raise RewriteError(f"{name}: rules still firing after {MAX_SWEEPS} sweeps over {graph.name!r}")
    if not changed:
        return graph
    out = work.to_graph()
    try:
        return verify(out)
    except VerifyError as e:
        raise RewriteError(f"{name}: produced an invalid graph: {e}") from None
