"""networkx view of a graph and pictures of it (DOT always, PNG/SVG where graphviz is installed).

Command line: `python -m dflash_ir.visualize GRAPH.{yaml,txt} -o OUT.{dot,png,svg}`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import networkx as nx

from .ir import Graph


def to_networkx(graph: Graph) -> nx.DiGraph:
    """Nodes are IR nodes (by index) plus graph inputs, weights and states; edges carry value names."""
    g = nx.DiGraph(name=graph.name)
    producer: dict[str, str] = {}
    for v in graph.inputs:
        g.add_node(f"in:{v.name}", kind="input", label=f"{v.name}\n{v.type}")
        producer[v.name] = f"in:{v.name}"
    for w in graph.weights:
        g.add_node(f"w:{w.value.name}", kind="weight", label=f"{w.tensor}\n{w.value.type}")
        producer[w.value.name] = f"w:{w.value.name}"
    for s in graph.states:
        g.add_node(f"st:{s.value.name}", kind="state", label=f"{s.value.name}\n{s.value.type}")
        producer[s.value.name] = f"st:{s.value.name}"
    for i, n in enumerate(graph.nodes):
        key = f"n{i}"
        outs = ", ".join(str(v.type) for v in n.outputs)
        g.add_node(key, kind="op", op=n.op, label=f"{n.op}\n{outs}")
        for inp in n.inputs:
            if inp in producer:
                g.add_edge(producer[inp], key, value=inp)
        for v in n.outputs:
            producer[v.name] = key
    for out_name, value_name in graph.outputs:
        g.add_node(f"out:{out_name}", kind="output", label=out_name)
        if value_name in producer:
            g.add_edge(producer[value_name], f"out:{out_name}", value=value_name)
    for s in graph.states:
        if s.update and s.update in producer:
            g.add_edge(producer[s.update], f"st:{s.value.name}", value=s.update, update=True)
    return g


_STYLE = {
    "input": 'shape=ellipse style=filled fillcolor="#d6eaff"',
    "weight": 'shape=note style=filled fillcolor="#eeeeee"',
    "state": 'shape=cylinder style=filled fillcolor="#ffe9c7"',
    "op": 'shape=box style="rounded,filled" fillcolor="#ffffff"',
    "output": 'shape=ellipse style=filled fillcolor="#d9f5d0"',
}


def to_dot(graph: Graph) -> str:
    g = to_networkx(graph)
    lines = [f"digraph {json.dumps(graph.name)} {{", "  rankdir=TB; node [fontname=Helvetica fontsize=10];"]
    for key, data in g.nodes(data=True):
        lines.append(f"  {json.dumps(key)} [label={json.dumps(data['label'])} {_STYLE[data['kind']]}];")
    for a, b, data in g.edges(data=True):
        style = " style=dashed constraint=false" if data.get("update") else ""
        lines.append(f"  {json.dumps(a)} -> {json.dumps(b)} [tooltip={json.dumps(data['value'])}{style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(graph: Graph, out: Path) -> Path:
    """Write a picture; the suffix picks the format (.dot needs nothing, .png/.svg need graphviz's `dot`)."""
    out = Path(out)
    dot = to_dot(graph)
    if out.suffix == ".dot":
        out.write_text(dot)
        return out
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError(f"cannot write {out}: graphviz's `dot` is not installed (Debian: apt-get install graphviz); "
                           "write a .dot file instead")
    subprocess.run([exe, f"-T{out.suffix.lstrip('.')}", "-o", str(out)], input=dot.encode(), check=True)
    return out


def load_graph_file(path: Path) -> Graph:
    from .printer import parse_graph
    from .serialize import load_yaml

    text = Path(path).read_text()
    return parse_graph(text) if text.lstrip().startswith("graph ") else load_yaml(text, str(path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_ir.visualize", description="Draw an IR graph.")
    p.add_argument("graph", type=Path, help="graph in text (.txt) or YAML form")
    p.add_argument("-o", "--output", type=Path, required=True, help="picture to write: .dot, .png or .svg")
    args = p.parse_args(argv)
    print(render(load_graph_file(args.graph), args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
