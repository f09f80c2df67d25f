"""The vocabulary of a cluster controller's control row, in one place (no SQLAlchemy: the CLI
reads it at start-up).

The cluster's controllers — the governor and the autopilot — each keep one row per cluster in
``controller_control`` (``GovernanceRepository.control`` / ``set_control``): armed, dry-run or
disarmed, paused, who set that and when, and the controller's own status. The operator steers
both the same way: ``tailpilot governor|autopilot ACTION``, the TUI's G and O.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

__all__ = ["CONTROLLERS", "CONTROL_ACTIONS", "CONTROL_DEFAULT", "CONTROL_STATES", "ControllerName"]

ControllerName = Literal["governor", "autopilot"]
CONTROLLERS: tuple[ControllerName, ...] = get_args(ControllerName)
CONTROL_STATES = ("armed", "dry-run", "disarmed")
# A control row as read when none was written: dry-run, not paused.
CONTROL_DEFAULT: dict[str, Any] = {
    "state": "dry-run", "paused": False, "who": None, "updated_ms": None, "status": None,
}  # fmt: skip
# What an operator's command changes in a controller's row; ``status`` reads it, changes nothing.
CONTROL_ACTIONS: dict[str, dict[str, Any]] = {
    "status": {},
    "arm": {"state": "armed"},
    "dry-run": {"state": "dry-run"},
    "pause": {"paused": True},
    "resume": {"paused": False},
    "disarm": {"state": "disarmed"},
}
