"""YAML for files dflash-ir reads back (artifact manifests, graphs): plain data, bounded.

PyYAML's loaders compose the whole node tree recursively (libyaml's composer overflows the
C stack on a deeply nested file) and expand aliases (a few lines of anchors make a
billion-entry document). This loader builds the data from libyaml's event stream instead,
without recursion, and refuses what our own dumps never contain: nesting deeper than
MAX_DEPTH, anchors and aliases, explicit tags, duplicate keys, more than one document, and
scalars other than strings, numbers, booleans and null. Each refusal is a StrictYAMLError
naming the source and the line.
"""
from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import ScalarNode
from yaml.resolver import Resolver

MAX_DEPTH = 64
_PARSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # libyaml's parser where PyYAML has it
_SCALAR_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null")}
_NO_KEY = object()


class StrictYAMLError(ValueError):
    """A YAML file outside what strict loading accepts (or not YAML at all)."""


def load(text: str, source: str) -> Any:
    """The one document of `text` as plain dicts, lists and scalars."""
    builder = _Builder(source)
    try:
        for event in yaml.parse(text, Loader=_PARSER):
            builder.add(event)
    except yaml.YAMLError as e:
        raise StrictYAMLError(f"{source}: not valid YAML ({' '.join(str(e).split())})") from None
    return builder.root


class _Builder:
    def __init__(self, source: str):
        self.source = source
        self.root: Any = None
        self.documents = 0
        self.stack: list[list] = []   # [container, pending mapping key]
        self.constructor = SafeConstructor()
        self.resolver = Resolver()
        self.plain: dict[str, Any] = {}   # plain scalar text -> its value (names and numbers repeat)
        self.handlers = {yaml.ScalarEvent: self.on_scalar, yaml.MappingStartEvent: self.on_start,
                         yaml.SequenceStartEvent: self.on_start, yaml.MappingEndEvent: self.on_end,
                         yaml.SequenceEndEvent: self.on_end, yaml.DocumentStartEvent: self.on_document,
                         yaml.AliasEvent: self.on_alias}

    def error(self, event, problem: str) -> StrictYAMLError:
        return StrictYAMLError(f"{self.source}: line {event.start_mark.line + 1}: {problem}")

    def add(self, event) -> None:
        if getattr(event, "anchor", None):
            self.on_alias(event)
        handler = self.handlers.get(type(event))
        if handler is not None:
            handler(event)

    def on_alias(self, event) -> None:
        raise self.error(event, "anchors and aliases are not accepted")

    def on_document(self, event) -> None:
        self.documents += 1
        if self.documents > 1:
            raise self.error(event, "more than one YAML document")

    def on_start(self, event) -> None:
        if not event.implicit:
            raise self.error(event, f"explicit tag {event.tag!r} is not accepted")
        if len(self.stack) >= MAX_DEPTH:
            raise self.error(event, f"nested deeper than {MAX_DEPTH} levels")
        container: Any = [] if type(event) is yaml.SequenceStartEvent else {}
        self.attach(event, container)
        self.stack.append([container, _NO_KEY])

    def on_end(self, event) -> None:
        self.stack.pop()

    def on_scalar(self, event) -> None:
        if event.tag is None and event.style:   # quoted or block scalars are strings
            value = event.value
        elif event.tag is None and event.value in self.plain:
            value = self.plain[event.value]
        else:
            value = self.construct(event)
            if event.tag is None:
                self.plain[event.value] = value
        self.attach(event, value)

    def construct(self, event) -> Any:
        tag = event.tag
        if tag is None or tag == "!":
            tag = self.resolver.resolve(ScalarNode, event.value, event.implicit)
        if tag not in _SCALAR_TAGS:
            raise self.error(event, f"scalar tag {tag!r} is not accepted")
        node = ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
        return SafeConstructor.yaml_constructors[tag](self.constructor, node)

    def attach(self, event, value: Any) -> None:
        if not self.stack:
            self.root = value
            return
        top = self.stack[-1]
        container = top[0]
        if type(container) is list:
            container.append(value)
        elif top[1] is _NO_KEY:
            if isinstance(value, (dict, list)):
                raise self.error(event, "a mapping key must be a scalar")
            if value in container:
                raise self.error(event, f"duplicate key {value!r}")
            top[1] = value
        else:
            container[top[1]] = value
            top[1] = _NO_KEY
