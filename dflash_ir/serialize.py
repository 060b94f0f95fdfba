"""YAML/JSON form of a graph: plain dicts, for artifacts and tools.

Graphs are read back with strict_yaml (bounded depth, no aliases or tags), and a dict that
is not a graph is a GraphFormatError naming the source and the missing or malformed field.
"""
from __future__ import annotations

from typing import Any

import yaml

from . import strict_yaml
from .ir import Graph, Node, State, Value, Weight, freeze_attr
from .types import parse_type

FORMAT = "dflash-ir.graph/1"

# libyaml's dumper when PyYAML was built with it: artifact graphs are large
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class GraphFormatError(ValueError):
    """A serialised graph that is not one; names the source and the field."""


def _value(v: Value) -> dict[str, str]:
    return {"name": v.name, "type": str(v.type)}


def _unvalue(d: dict) -> Value:
    return Value(d["name"], parse_type(d["type"]))


def graph_to_dict(g: Graph) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "name": g.name,
        "meta": _plain(dict(g.meta)),
        "inputs": [_value(v) for v in g.inputs],
        "weights": [{**_value(w.value), "tensor": w.tensor, "source": w.source} for w in g.weights],
        "states": [{**_value(s.value), "update": s.update} for s in g.states],
        "nodes": [
            {"op": n.op, "inputs": list(n.inputs), "outputs": [_value(v) for v in n.outputs], "attrs": _plain(dict(n.attrs))}
            for n in g.nodes
        ],
        "outputs": [{"name": o, "value": v} for o, v in g.outputs],
    }


def graph_from_dict(d: dict[str, Any], source: str = "<graph>") -> Graph:
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        found = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise GraphFormatError(f"{source}: not a serialised graph of format {FORMAT!r} (found {found!r})")
    try:
        return _graph(d)
    except KeyError as e:
        raise GraphFormatError(f"{source}: a graph field is missing: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise GraphFormatError(f"{source}: malformed graph ({type(e).__name__}: {e})") from None


def _graph(d: dict[str, Any]) -> Graph:
    return Graph(
        name=d["name"],
        inputs=tuple(_unvalue(v) for v in d["inputs"]),
        weights=tuple(Weight(_unvalue(w), w["tensor"], w["source"]) for w in d["weights"]),
        states=tuple(State(_unvalue(s), s.get("update")) for s in d["states"]),
        nodes=tuple(Node.make(n["op"], n["inputs"], [_unvalue(v) for v in n["outputs"]], n["attrs"]) for n in d["nodes"]),
        outputs=tuple((o["name"], o["value"]) for o in d["outputs"]),
        meta=tuple(sorted((k, freeze_attr(v)) for k, v in (d.get("meta") or {}).items())),
    )


def dump_yaml(g: Graph) -> str:
    return yaml.dump(graph_to_dict(g), Dumper=YAML_DUMPER, sort_keys=False, width=120)


def load_yaml(text: str, source: str = "<graph>") -> Graph:
    return graph_from_dict(strict_yaml.load(text, source), source)


def _plain(v: Any) -> Any:
    """Tuples to lists so safe_dump writes plain YAML sequences."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v
