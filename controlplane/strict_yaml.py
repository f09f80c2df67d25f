"""The one YAML loader tailpilot reads with: PyYAML's safe loader, refusing duplicate keys.

``yaml.safe_load`` keeps the last of two equal keys in a mapping without a word, so a cluster file
that names ``timeout_s`` twice runs with whichever came second. Here that is an error naming the key
and both lines. Merge keys (``<<: *base``) still work: a key given beside a merge overrides it.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

_MERGE_TAG = "tag:yaml.org,2002:merge"


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping holding the same key twice."""

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
