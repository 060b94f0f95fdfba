"""The readable text form of a graph, and its parser (the two round-trip exactly).

    graph "mlp" {
      input %x: f32[T,64]
      weight %w: q8_0[192,64] = model["blk.0.ffn_up.weight"]
      state %k_cache: f32[C,2,64] <- %k_cache.new
      %y: f32[T,192] = matmul(%x, %w.f32) {"axis": -1}
      output "y" = %y
    }
"""
from __future__ import annotations

import json
import re

from .ir import Graph, Node, State, Value, Weight, freeze_attr
from .types import parse_type

_NAME = r"[^\s,():=<]+"


def format_graph(graph: Graph) -> str:
    lines = [f"graph {json.dumps(graph.name)} {{"]
    if graph.meta:
        lines.append(f"  meta {json.dumps(dict(graph.meta))}")
    for v in graph.inputs:
        lines.append(f"  input {v}")
    for w in graph.weights:
        lines.append(f"  weight {w.value} = {w.source}[{json.dumps(w.tensor)}]")
    for s in graph.states:
        lines.append(f"  state {s.value}" + (f" <- %{s.update}" if s.update else ""))
    for n in graph.nodes:
        lines.append("  " + format_node(n))
    for out_name, value_name in graph.outputs:
        lines.append(f"  output {json.dumps(out_name)} = %{value_name}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def format_node(n: Node) -> str:
    outs = ", ".join(str(v) for v in n.outputs)
    args = ", ".join(f"%{i}" for i in n.inputs)
    attrs = f" {json.dumps(dict(n.attrs))}" if n.attrs else ""
    return f"{outs} = {n.op}({args}){attrs}"


class ParseError(ValueError):
    pass


_VALUE = re.compile(rf"%({_NAME}): (\w+\[[^\]]*\])")
_HEADER = re.compile(r'graph (".*") \{$')
_INPUT = re.compile(rf"input {_VALUE.pattern}$")
_WEIGHT = re.compile(rf'weight {_VALUE.pattern} = (\w+)\[(".*")\]$')
_STATE = re.compile(rf"state {_VALUE.pattern}(?: <- %({_NAME}))?$")
_OUTPUT = re.compile(rf'output (".*") = %({_NAME})$')
_NODE = re.compile(rf"(.+?) = ([\w.]+)\(([^)]*)\)(?: (\{{.*\}}))?$")


def parse_graph(text: str) -> Graph:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines or not (m := _HEADER.match(lines[0])) or lines[-1] != "}":
        raise ParseError("expected 'graph \"name\" { ... }'")
    name = json.loads(m.group(1))
    meta: dict = {}
    inputs, weights, states, nodes, outputs = [], [], [], [], []
    for lineno, line in enumerate(lines[1:-1], start=2):
        try:
            if line.startswith("meta "):
                meta = json.loads(line[5:])
            elif m := _INPUT.match(line):
                inputs.append(Value(m.group(1), parse_type(m.group(2))))
            elif m := _WEIGHT.match(line):
                weights.append(Weight(Value(m.group(1), parse_type(m.group(2))), json.loads(m.group(4)), m.group(3)))
            elif m := _STATE.match(line):
                states.append(State(Value(m.group(1), parse_type(m.group(2))), m.group(3)))
            elif m := _OUTPUT.match(line):
                outputs.append((json.loads(m.group(1)), m.group(2)))
            elif m := _NODE.match(line):
                outs = [Value(v.group(1), parse_type(v.group(2))) for v in _VALUE.finditer(m.group(1))]
                args = [a.strip().lstrip("%") for a in m.group(3).split(",") if a.strip()]
                attrs = json.loads(m.group(4)) if m.group(4) else {}
                nodes.append(Node.make(m.group(2), args, outs, attrs))
            else:
                raise ParseError("unrecognised line")
        except (ValueError, TypeError) as e:
            raise ParseError(f"line {lineno}: {e}: {line!r}") from None
    return Graph(
        name=name,
        inputs=tuple(inputs),
        weights=tuple(weights),
        states=tuple(states),
        nodes=tuple(nodes),
        outputs=tuple(outputs),
        meta=tuple(sorted((k, freeze_attr(v)) for k, v in meta.items())),
    )
