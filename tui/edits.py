"""Settings edits the operator stages in the TUI, validated by the one settings model.

Nothing here validates on its own: every candidate document goes through
:class:`scheduler.settings.Settings` (``model_validate``) and every error message comes from
:func:`scheduler.settings.describe_error`. Input text is read with the CLI's
:func:`scheduler.settings_change.parse_assignment` (``8`` → 8, ``on`` → True, JSON otherwise).
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Container, Mapping, Set
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from scheduler.settings import ADAPTIVE_PARAMS, PARAM_MODELS, Settings, describe_error
from scheduler.settings_change import SettingsChange, fmt_value, parse_assignment


def try_apply(edit: Edit, current: Settings) -> tuple[Settings | None, str | None]:
    """(new settings, None) or (None, the settings model's message naming the field)."""
    try:
        return edit.apply(current), None
    except (ValidationError, ValueError) as err:
        return None, describe_error(err)


def edit_targets(selected: Set[str], cursor: str | None, known: Container[str] | None) -> list[str]:
    """The replicas a change goes to (what P, N and A act on): the selected ones, those of them
    still ``known`` when the cluster's replicas are known; else the replica under the cursor."""
    if selected:
        return sorted(n for n in selected if known is None or n in known)
    return [cursor] if cursor else []


def current_settings(doc: Mapping[str, Any] | None) -> Settings | None:
    """A replica's settings document as a Settings (None if unknown or invalid)."""
    if not doc:
        return None
    try:
        return Settings.model_validate(dict(doc))
    except (ValidationError, ValueError):
        return None


def _defaults(policy: Any) -> dict[str, Any] | None:
    model = PARAM_MODELS.get(policy) if isinstance(policy, str) else None
    return model().model_dump() if model is not None else None


def settings_diff(
    old: Mapping[str, Any] | None, new: Mapping[str, Any] | None
) -> list[tuple[str, str, str]]:
    """(field, old, new) for every leaf that differs between two settings documents.

    Across a policy switch the old policy's parameters are not listed one by one (they all go):
    the new policy's parameters are listed only where they differ from its defaults."""
    old, new = dict(old or {}), dict(new or {})
    out: list[tuple[str, str, str]] = []
    op, np_ = old.get("params") or {}, new.get("params") or {}
    if old.get("policy") != new.get("policy"):
        out.append(("policy", str(old.get("policy", "—")), str(new.get("policy", "—"))))
        defaults = _defaults(new.get("policy")) or {}
        for k, v in np_.items():
            if k not in defaults or defaults[k] != v:
                out.append((f"params.{k}", "default" if k in defaults else "—", fmt_value(v)))
    else:
        for k in list(np_) + [k for k in op if k not in np_]:
            a, b = op.get(k, None), np_.get(k, None)
            if a != b:
                out.append(
                    (
                        f"params.{k}",
                        "—" if k not in op else fmt_value(a),
                        "—" if k not in np_ else fmt_value(b),
                    )
                )
    a, b = list(old.get("pinned") or []), list(new.get("pinned") or [])
    if sorted(a) != sorted(b):
        out.append(("pinned", fmt_value(a), fmt_value(b)))
    oe, ne = old.get("engine") or {}, new.get("engine") or {}
    for k in ne:
        if oe.get(k) != ne.get(k):
            out.append((f"engine.{k}", fmt_value(oe.get(k, "—")), fmt_value(ne.get(k))))
    return out


def diff_summary(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str:
    """One line: ``policy sarathi→uniboost; params.gamma 10→8; pinned []→["gamma"]``."""
    return "; ".join(f"{f} {a}→{b}" for f, a, b in settings_diff(old, new)) or "no change"


# ---------------------------------------------------------------------------------- form fields


@dataclass(frozen=True)
class FieldSpec:
    """One parameter of a policy, as the policy panel shows it."""

    name: str
    kind: str  # "bool" | "choice" | "int" | "float" | "json"
    default: Any
    choices: tuple[str, ...] = ()
    hint: str = ""  # bounds and default, e.g. "> 0, ≤ 1e+06; default 10"
    adaptive: bool = False  # moved by adaptation (γ-Ada, adaptive β) unless pinned


def _kind(annotation: Any) -> tuple[str, tuple[str, ...]]:
    if annotation is bool:
        return "bool", ()
    if typing.get_origin(annotation) is Literal:
        return "choice", tuple(str(a) for a in typing.get_args(annotation))
    if annotation is int:
        return "int", ()
    if annotation is float:
        return "float", ()
    if isinstance(annotation, types.GenericAlias) or typing.get_origin(annotation) is dict:
        return "json", ()
    return "json", ()


def _bounds(info: Any) -> str:
    words = []
    for m in getattr(info, "metadata", ()):
        for attr, sym in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            v = getattr(m, attr, None)
            if v is not None:
                words.append(f"{sym} {v:g}" if isinstance(v, (int, float)) else f"{sym} {v}")
    return ", ".join(words)


def policy_fields(policy: str) -> list[FieldSpec]:
    """Every parameter of ``policy`` from :data:`scheduler.settings.PARAM_MODELS`, in order."""
    model = PARAM_MODELS[policy]
    adaptive = set(ADAPTIVE_PARAMS.get(policy, ()))
    out = []
    for name, info in model.model_fields.items():
        kind, choices = _kind(info.annotation)
        default = info.get_default(call_default_factory=True)
        bounds = _bounds(info)
        hint = "; ".join(x for x in (bounds, f"default {fmt_value(default)}") if x)
        out.append(FieldSpec(name, kind, default, choices, hint, name in adaptive))
    return out


def field_text(spec: FieldSpec, value: Any) -> str:
    """How a parameter value is written in its input box."""
    if spec.kind == "json":
        return json.dumps(value, sort_keys=True)
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)


def parse_field(spec: FieldSpec, text: str) -> Any:
    """Input text → a value for the settings model to judge (never judged here)."""
    if spec.kind == "choice":
        return text
    _, value = parse_assignment(f"{spec.name}={text}")
    return value


def field_errors(message: str | None, names: list[str]) -> dict[str, str]:
    """Split a describe_error message into the parts about each parameter (``params.gamma:
    ...``)."""
    if not message:
        return {}
    out: dict[str, str] = {}
    for name in names:
        m = re.search(rf"params\.{re.escape(name)}(?:\.[\w.]+)?: ([^;]*)", message)
        if m:
            out[name] = m.group(1).strip()
        elif re.search(rf"\b{re.escape(name)}\b", message) and "params." not in message:
            out[name] = message  # a model-level rule naming the field (gamma_min > gamma_max)
    return out


def pin_edit(
    settings: Settings | None, policy: str | None, live: Mapping[str, float | None]
) -> tuple[SettingsChange | None, str]:
    """The ``N`` key: pin the adaptive parameter at its live value, or unpin it if pinned.

    Returns (edit, what) or (None, why not)."""
    policy = settings.policy if settings is not None else policy
    names = ADAPTIVE_PARAMS.get(policy or "", ())
    if not names:
        return None, f"{policy or 'unknown policy'} has no adaptive parameter to pin"
    name = names[0]
    if settings is not None and settings.is_pinned(name):
        return SettingsChange(unpin=frozenset({name})), f"unpin {name}"
    value = live.get(name)
    if value is None and settings is not None:
        value = settings.param(name)
    if value is None:
        return None, f"no live {name} known yet"
    value = float(f"{value:.4g}")
    return SettingsChange(params={name: value}, pin=frozenset({name})), f"pin {name} at {value:g}"


# ------------------------------------------------------------------------ applying a recommendation


@dataclass(frozen=True)
class RecommendationEdit:
    """The ``R`` key of the tuner panel: a study's recommended settings document, applied to a
    replica's current settings with that replica's **pinned parameters kept**
    (docs/policies.md#settings-document: an applied recommendation never changes a pinned parameter
    unless the operator unpins it).

    What the confirmation shows of ``SettingsChange.recommendation`` (the study, the trial, the
    pins kept), which ``apply`` builds: the same confirmation and ``apply_settings`` path as
    every other edit. When the replica pins a parameter and the recommendation switches it to
    another policy, the pin could not be kept: that replica is refused (not sent) with the
    reason, and the operator unpins first.
    """

    settings: Mapping[str, Any]
    study: str = ""
    trial: int | None = None

    def apply(self, current: Settings) -> Settings:
        return SettingsChange.recommendation(self.settings).apply(current)

    @property
    def empty(self) -> bool:
        return False

    def kept_pins(self, current: Settings | None) -> list[tuple[str, str, str]]:
        """(name, the replica's value kept, the recommended value not applied) per pinned
        parameter."""
        if current is None or not current.pinned:
            return []
        rec = dict(self.settings).get("params") or {}
        return [
            (n, fmt_value(current.param(n)), fmt_value(rec[n]) if n in rec else "—")
            for n in current.pinned
        ]

    def describe(self) -> str:
        what = f"recommendation of study {self.study}" if self.study else "recommendation"
        if self.trial is not None:
            what += f" (trial {self.trial})"
        return what


Edit = SettingsChange | RecommendationEdit
"""What the confirm dialog and the apply worker take: either edit (``apply``, ``describe``)."""
