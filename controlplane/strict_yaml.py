"""The one YAML loader tailpilot reads with — PyYAML's safe loader, refusing duplicate keys and
nesting deeper than :data:`MAX_DEPTH` — and the one writer its exports use (:func:`dump`).

``yaml.safe_load`` keeps the last of two equal keys in a mapping without a word, so a cluster file
that names ``timeout_s`` twice runs with whichever came second. Here that is an error naming the key
and both lines. Merge keys (``<<: *base``) still work: a key given beside a merge overrides it.

PyYAML composes and constructs nested collections recursively: a document 5,000 lists deep ends in
a ``RecursionError`` thousands of lines long. Here a collection nested deeper than ``MAX_DEPTH``
levels is a ``yaml.YAMLError`` naming its line and the limit, raised before the recursion is deep.

:func:`dump` writes what Kubernetes and Prometheus read (ConfigMaps, helm values, alert rules,
ServiceMonitors): keys in the document's order, multi-line strings as literal blocks, and any plain
string another YAML reader could take for a number, a boolean or null double-quoted.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.events import CollectionStartEvent
from yaml.nodes import MappingNode, Node

_MERGE_TAG = "tag:yaml.org,2002:merge"

# Nesting levels of collections a document may have. tailpilot's deepest file (a cluster file's
# tenant SLO vector: clusters[0].governance.tenants.NAME.ttft.p99) is 6 deep; 64 leaves room for
# any hand-written structure and keeps composing and constructing far from Python's recursion limit.
MAX_DEPTH = 64


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping holding the same key twice, and collections
    nested deeper than :data:`MAX_DEPTH`."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.collection_depth = 0  # collections open around the node being composed

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        # Counted here, before the composer recurses into the collection, so a deep document
        # stops at the limit; an alias never recurses (it names a node composed already).
        opens = self.check_event(CollectionStartEvent)
        if opens:
            if self.collection_depth >= MAX_DEPTH:
                raise ComposerError(
                    None,
                    None,
                    f"collections nested deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark,
                )
            self.collection_depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            if opens:
                self.collection_depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: the safe loader's own error says so
                if first is not key_node:
                    raise ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"duplicate key {key!r} (first on line {first.start_mark.line + 1})",
                        key_node.start_mark,
                    )
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def load(text: str) -> Any:
    """The YAML document in ``text``; ``yaml.YAMLError`` (with the line) if it is malformed."""
    return yaml.load(text, Loader=StrictLoader)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the settings JSON in a ConfigMap) as literal blocks, readable in
    kubectl."""


# Plain scalars another YAML reader could take for a number, a boolean or null (YAML 1.1 or 1.2;
# Kubernetes' reader turns an unquoted 1e3 or 0o17 into a number): written double-quoted.
_AMBIGUOUS = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)?\.?[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?0[xXoObB][0-9a-fA-F_]+|[0-9]+(?::[0-9]+)+"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)|[yYnN~]|yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE"
    r"|on|On|ON|off|Off|OFF|null|Null|NULL|)$"
)


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    if _AMBIGUOUS.match(value):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"')
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str_representer)


def dump(doc: dict[str, Any], header: Sequence[str] = ()) -> str:
    """``doc`` as YAML (see the module docstring), after ``header``'s lines as ``#`` comments
    wrapped at 96 characters (an empty line: a bare ``#``)."""
    body: str = yaml.dump(
        doc,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=100,
    )
    lines = []
    for line in header:
        lines += textwrap.wrap(line, 96, break_on_hyphens=False) or [""]
    return "".join(f"# {line}\n" if line else "#\n" for line in lines) + body
