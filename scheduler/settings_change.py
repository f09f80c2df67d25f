"""A change of a settings document (``scheduler.settings``): the one path every change takes.

``SettingsChange`` says what changes — the policy, parameter values, engine limits, pins added
and removed — and ``apply(current)`` makes the new document of the one a replica runs, validated
once there. ``tailpilot set`` and the TUI build one from an operator's words (``parse``: the
``name=value`` assignments, split in one place, ``split_assignment``; tests/test_layers.py fails on
a second), the governor and the autopilot from their decisions; ``controlplane.steering`` carries
it to the replica, whose PUT validates it again. ``with_engine`` fills the engine fields a whole
document leaves out from the replica's own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.settings import EngineSettings, Settings

__all__ = [
    "SettingsChange",
    "fmt_value",
    "parse_assignment",
    "settings_from_cli",
    "split_assignment",
    "with_engine",
]


def split_assignment(
    text: str, *, last: bool = False, strip: bool = False
) -> tuple[str, str] | None:
    """``NAME=VALUE`` split into (NAME, VALUE), or None when there is no ``=`` or no name.
    ``last``: at the last ``=`` (a file path may hold one); ``strip``: both parts stripped of
    surrounding blanks. The one place a ``name=value`` is taken apart — ``--set``, the TUI's
    edits, ``KEY=VALUE`` options, search ranges, a ``vllm serve`` line's environment
    (tests/test_layers.py fails on a second)."""
    name, sep, raw = text.rpartition("=") if last else text.partition("=")
    if strip:
        name, raw = name.strip(), raw.strip()
    if not sep or not name:
        return None
    return name, raw


def parse_assignment(text: str) -> tuple[str, Any]:
    """Parse a CLI ``name=value`` into (name, value) with JSON-ish typing (8 → 8, on → True)."""
    parts = split_assignment(text, strip=True)
    if parts is None:
        raise ValueError(f"--set {text!r}: expected name=value")
    name, raw = parts
    lowered = raw.lower()
    if lowered in ("on", "true", "yes"):
        return name, True
    if lowered in ("off", "false", "no"):
        return name, False
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


def with_engine(doc: Mapping[str, Any], engine: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with the engine fields it leaves out taken from ``engine`` — a replica's own
    (a PUT, ``tailpilot set`` sending a whole document) or vLLM's (a settings file at start-up):
    not the model's defaults, which would read as a restart-required change. An engine block
    that is not an object is left for validation to name. The one place this is done."""
    given = doc.get("engine", {})
    if not isinstance(given, Mapping):
        return dict(doc)
    return {**doc, "engine": {**engine, **given}}


def settings_from_cli(
    policy: str,
    assignments: Sequence[str] = (),
    pinned: Sequence[str] = (),
    engine: dict[str, int] | None = None,
) -> Settings:
    """Build settings from CLI flags; engine.* names in assignments go to the engine block (the
    routing of :meth:`SettingsChange.parse`)."""
    given = SettingsChange.parse(policy, assignments)
    return Settings.model_validate(
        {
            "policy": policy,
            "params": dict(given.params),
            "pinned": list(pinned),
            "engine": {**(engine or {}), **given.engine},
        }
    )


@dataclass(frozen=True)
class SettingsChange:
    """One change of a replica's settings, the value every path builds — ``tailpilot set``
    (:meth:`parse`), the TUI's staged edit — and ``controlplane.steering`` carries to the replica:
    a policy switch, parameter values, engine limits, pins added and removed.

    :meth:`apply` makes the new document of a replica's current one, validated once, there:
    switching to another policy starts from that policy's defaults, then the parameters are
    merged; the engine fields given replace the replica's, the
    others are kept; ``unpin`` drops names from ``pinned`` and ``pin`` adds the new ones (sorted)
    after the replica's own.
    """

    policy: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    engine: Mapping[str, Any] = field(default_factory=dict)
    pin: frozenset[str] = frozenset()
    unpin: frozenset[str] = frozenset()
    # A whole settings document that replaces the replica's (``whole``, ``recommendation``): the
    # engine fields it leaves out are the replica's (``with_engine``); the fields above are then
    # applied to it.
    document: Mapping[str, Any] | None = None
    # With ``document``: the replica's pinned parameters keep their values and stay pinned (an
    # applied recommendation never moves a pin); a switch of policy over a pin is refused.
    keep_pins: bool = False

    @classmethod
    def whole(cls, document: Mapping[str, Any] | Settings) -> SettingsChange:
        """A whole document sent as it is — the control API's PUT, a script's
        ``apply_settings(..., {"policy": "fcfs"})`` — its missing engine fields the replica's.
        The document is copied: changing the caller's afterwards does not change the change."""
        return cls(document=_document(document))

    @classmethod
    def recommendation(cls, document: Mapping[str, Any] | Settings) -> SettingsChange:
        """A study's recommended document applied with the replica's pins kept (the TUI's ``R``,
        docs/policies.md#settings-document)."""
        return cls(document=_document(document), keep_pins=True)

    @classmethod
    def parse(
        cls,
        policy: str | None = None,
        assignments: Sequence[str] = (),
        pins: Sequence[str] = (),
        unpins: Sequence[str] = (),
    ) -> SettingsChange:
        """From the command line's words: ``NAME=VALUE`` assignments (``parse_assignment``)
        go to the engine block for ``engine.NAME`` and the engine's own field names, to the
        parameters otherwise; ValueError naming a malformed one."""
        params: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        for item in assignments:
            name, value = parse_assignment(item)
            if name.startswith("engine.") or name in EngineSettings.model_fields:
                engine[name.removeprefix("engine.")] = value
            else:
                params[name] = value
        both = sorted(set(pins) & set(unpins))
        if both:  # which should win is the operator's to say, not an order of operations
            raise ValueError(f"--pin and --unpin both name {', '.join(both)}")
        return cls(policy, params, engine, frozenset(pins), frozenset(unpins))

    def apply(self, current: Settings) -> Settings:
        if self.document is not None:
            current = self._replace(current)
            if self.delta_empty:
                return current
        doc = current.to_dict()
        if self.policy is not None and self.policy != current.policy:
            doc["policy"], doc["params"], doc["pinned"] = self.policy, {}, []
        doc["params"] = {**doc["params"], **dict(self.params)}
        doc["engine"] = {**doc["engine"], **dict(self.engine)}
        pinned = [p for p in doc["pinned"] if p not in self.unpin]
        pinned += sorted(p for p in self.pin if p not in pinned)
        doc["pinned"] = pinned
        return Settings.model_validate(doc)

    def on_engine(self, engine: Mapping[str, Any]) -> Settings:
        """``document`` (a whole one, ``keep_pins`` aside) validated with ``engine``'s fields where
        it leaves them out: what a replica that reports only its engine block is sent."""
        assert self.document is not None, "on_engine of a change without a document"
        return Settings.model_validate(with_engine(self.document, engine))

    def _replace(self, current: Settings) -> Settings:
        """``document`` made the replica's: validated once, with the replica's engine fields
        where it leaves them out and, with ``keep_pins``, the replica's pinned values."""
        new = self.on_engine(current.engine.model_dump())
        if not (self.keep_pins and current.pinned):
            return new
        if new.policy != current.policy:
            raise ValueError(
                f"pinned {', '.join(current.pinned)} on {current.policy}: the recommendation "
                f"switches to {new.policy}; unpin first to apply it"
            )
        kept = new.to_dict()
        kept["params"] |= {name: current.param(name) for name in current.pinned}
        kept["pinned"] = list(current.pinned)
        return Settings.model_validate(kept)

    @property
    def is_whole(self) -> bool:
        """A whole document and nothing else (``whole``): the replica's engine fields are all it
        takes of the replica's settings."""
        return self.document is not None and not self.keep_pins and self.delta_empty

    @property
    def delta_empty(self) -> bool:
        """Whether nothing is changed beyond ``document`` (if any)."""
        return not (self.policy or self.params or self.engine or self.pin or self.unpin)

    @property
    def empty(self) -> bool:
        return self.document is None and self.delta_empty

    def describe(self) -> str:
        """The change in the words an operator typed (``policy=uniboost, gamma=0.5, pin
        gamma``)."""
        parts = ["whole settings document"] if self.document is not None else []
        parts += [f"policy={self.policy}"] if self.policy else []
        parts += [f"{k}={fmt_value(v)}" for k, v in self.params.items()]
        parts += [f"engine.{k}={fmt_value(v)}" for k, v in self.engine.items()]
        parts += [f"pin {p}" for p in sorted(self.pin)]
        parts += [f"unpin {p}" for p in sorted(self.unpin)]
        return ", ".join(parts) or "no change"


def _document(document: Mapping[str, Any] | Settings) -> dict[str, Any]:
    if isinstance(document, Settings):
        return document.to_dict()
    if not isinstance(document, Mapping):
        raise TypeError(f"a settings document is an object, got {type(document).__name__}")
    return dict(document)


def fmt_value(value: Any) -> str:
    """A parameter's value as an operator reads it: on/off, 6 significant digits, JSON (an unset
    optional parameter is ``null``, as ``name=null`` sets it)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True)
    return str(value)
