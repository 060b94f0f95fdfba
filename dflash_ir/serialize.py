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

class YAML_DUMPER(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    """libyaml's dumper when PyYAML was built with it (artifact graphs are large), writing a
    shared object out again each time: the strict loader refuses anchors and aliases."""

    def ignore_aliases(self, data) -> bool:
        return True


class GraphFormatError(ValueError):
    """A serialised graph that is not one; names the source and the field."""


def _value(v: Value) -> dict[str, str]:
    return {"name": v.name, "type": str(v.type)}


def _unvalue(d: dict, field: str) -> Value:
    if not isinstance(d, dict):
        raise ValueError(f"{field} must be a mapping with name and type, got {d!r}")
    return Value(_text(d["name"], f"{field}.name"), parse_type(_text(d["type"], f"{field}.type")))


def _text(v: Any, field: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{field} must be a string, got {v!r}")
    return v


def _items(v: Any, field: str) -> list:
    if not isinstance(v, list):
        raise ValueError(f"{field} must be a list, got {type(v).__name__}")
    return v


def _mapping(v: Any, field: str) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"{field} must be a mapping, got {type(v).__name__}")
    return v


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
    """The graph of a dict, every field checked for its type (a GraphFormatError names it)."""
    weights = [_mapping(w, f"weights[{i}]") for i, w in enumerate(_items(d["weights"], "weights"))]
    states = [_mapping(s, f"states[{i}]") for i, s in enumerate(_items(d["states"], "states"))]
    nodes = [_mapping(n, f"nodes[{i}]") for i, n in enumerate(_items(d["nodes"], "nodes"))]
    outputs = [_mapping(o, f"outputs[{i}]") for i, o in enumerate(_items(d["outputs"], "outputs"))]
    return Graph(
        name=_text(d["name"], "name"),
        inputs=tuple(_unvalue(v, f"inputs[{i}]") for i, v in enumerate(_items(d["inputs"], "inputs"))),
        weights=tuple(Weight(_unvalue(w, f"weights[{i}]"), _text(w["tensor"], f"weights[{i}].tensor"),
                             _text(w["source"], f"weights[{i}].source")) for i, w in enumerate(weights)),
        states=tuple(State(_unvalue(s, f"states[{i}]"), None if s.get("update") is None else
                           _text(s["update"], f"states[{i}].update")) for i, s in enumerate(states)),
        nodes=tuple(Node.make(_text(n["op"], f"nodes[{i}].op"),
                              [_text(x, f"nodes[{i}].inputs") for x in _items(n["inputs"], f"nodes[{i}].inputs")],
                              [_unvalue(v, f"nodes[{i}].outputs") for v in _items(n["outputs"], f"nodes[{i}].outputs")],
                              _mapping(n["attrs"] or {}, f"nodes[{i}].attrs")) for i, n in enumerate(nodes)),
        outputs=tuple((_text(o["name"], f"outputs[{i}].name"), _text(o["value"], f"outputs[{i}].value"))
                      for i, o in enumerate(outputs)),
        meta=tuple(sorted((k, freeze_attr(v)) for k, v in _mapping(d.get("meta") or {}, "meta").items())),
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
