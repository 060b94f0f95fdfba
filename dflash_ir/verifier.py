"""Graph verifier: the rules every graph obeys, before and after every pass."""
from __future__ import annotations

from .ir import Graph
from .ops.registry import OpError, get_op


class VerifyError(ValueError):
    """A graph breaks an IR rule; the message lists every problem found."""


def verify(graph: Graph) -> Graph:
    """Check names, definitions before use, op types, states and outputs; raise VerifyError."""
    problems: list[str] = []
    defined: dict[str, object] = {}

    def define(name: str, what: str) -> None:
        if name in defined:
            problems.append(f"value %{name} is defined twice ({defined[name]} and {what})")
        defined[name] = what

    for v in graph.inputs:
        define(v.name, "input")
    for w in graph.weights:
        define(w.value.name, f"weight {w.source}:{w.tensor}")
        if not w.value.type.dtype.is_float:
            problems.append(f"weight %{w.value.name} has non-float dtype {w.value.type.dtype}")
        if w.value.type.symbols:
            problems.append(f"weight %{w.value.name} has symbolic shape {w.value.type}")
    for s in graph.states:
        define(s.value.name, "state")
    for v in [*graph.inputs, *(s.value for s in graph.states)]:
        if v.type.dtype.is_block:
            problems.append(f"%{v.name} has block dtype {v.type.dtype}: only weights may be block-quantised")

    types = {}
    for v in graph.inputs:
        types[v.name] = v.type
    for w in graph.weights:
        types[w.value.name] = w.value.type
    for s in graph.states:
        types[s.value.name] = s.value.type

    for i, node in enumerate(graph.nodes):
        where = f"node {i} ({node.op})"
        missing = [n for n in node.inputs if n not in types]
        if missing:
            problems.append(f"{where} uses undefined value(s) {', '.join('%' + m for m in missing)}")
        try:
            opdef = get_op(node.op)
        except OpError as e:
            problems.append(f"{where}: {e}")
            opdef = None
        if opdef is not None and not missing:
            try:
                expected = opdef.output_types([types[n] for n in node.inputs], node.attr)
            except OpError as e:
                problems.append(f"{where}: {e}")
            else:
                declared = tuple(v.type for v in node.outputs)
                if expected != declared:
                    problems.append(
                        f"{where}: declared output types {', '.join(map(str, declared))} but the op rule gives "
                        f"{', '.join(map(str, expected))}"
                    )
        for v in node.outputs:
            define(v.name, where)
            types[v.name] = v.type

    produced = {v.name for n in graph.nodes for v in n.outputs}
    for s in graph.states:
        if s.update is None:
            continue
        if s.update not in types:
            problems.append(f"state %{s.value.name} is updated by undefined value %{s.update}")
        elif s.update not in produced:
            problems.append(f"state %{s.value.name} is updated by %{s.update}, which no node computes")
        elif types[s.update] != s.value.type:
            problems.append(f"state %{s.value.name}: update %{s.update} has type {types[s.update]}, state is {s.value.type}")
    updates = [s.update for s in graph.states if s.update is not None]
    for u in set(updates):
        if updates.count(u) > 1:
            problems.append(f"value %{u} updates more than one state")

    seen_outputs: set[str] = set()
    for out_name, value_name in graph.outputs:
        if out_name in seen_outputs:
            problems.append(f"output {out_name!r} is declared twice")
        seen_outputs.add(out_name)
        if value_name not in types:
            problems.append(f"output {out_name!r} refers to undefined value %{value_name}")
    if not graph.outputs and not updates:
        problems.append("graph has no outputs and updates no state")

    if problems:
        raise VerifyError(f"graph {graph.name!r} is malformed:\n  - " + "\n  - ".join(problems))
    return graph
