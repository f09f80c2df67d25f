"""The one YAML loader tailpilot reads with: PyYAML's safe loader, refusing duplicate keys and
nesting deeper than :data:`MAX_DEPTH`.

``yaml.safe_load`` keeps the last of two equal keys in a mapping without a word, so a cluster file
that names ``timeout_s`` twice runs with whichever came second. Here that is an error naming the key
and both lines. Merge keys (``<<: *base``) still work: a key given beside a merge overrides it.

PyYAML composes and constructs nested collections recursively: a document 5,000 lists deep ends in
a ``RecursionError`` thousands of lines long. Here a collection nested deeper than ``MAX_DEPTH``
levels is a ``yaml.YAMLError`` naming its line and the limit, raised before the recursion is deep.
"""

from __future__ import annotations

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
                raise ComposerError(None, None, f"collections nested deeper than {MAX_DEPTH} levels",
                                    self.peek_event().start_mark)
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
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {key!r} (first on line {first.start_mark.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """The YAML document in ``text``; ``yaml.YAMLError`` (with the line) if it is malformed."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
