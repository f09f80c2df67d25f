"""``GovernanceRepository``: a cluster's governance windows, alert events, and its controllers'
control rows.

The collector writes governance windows (multi-tenant figures: SCR, JFI, type fairness) and alert
transitions with its batches (``RecordingRepository.write``); this reads them back. The governor and
the autopilot each keep one control row per cluster — armed, dry-run or disarmed, paused, who set
that and when, and the controller's own status — which the TUI and the CLI read and change.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from storage.control import CONTROL_DEFAULT, CONTROL_STATES, CONTROLLERS, ControllerName
from storage.database import Database
from storage.models import AlertEvent, ControllerControl, GovernanceWindow, table
from storage.sql import in_range, insert_or_update


class GovernanceRepository:
    """Governance windows and alert events per cluster; the governor's and the autopilot's control
    rows."""

    def __init__(self, database: Database) -> None:
        self.database = database

    # ---------------------------------------------------------------- governance windows and alerts

    def windows(
        self,
        cluster: str,
        *,
        since_ms: int | None = None,
        until_ms: int | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """Stored governance windows of ``cluster`` (``since_ms <= t_ms < until_ms``), newest
        first: dicts with t_ms and summary."""
        stmt = select(GovernanceWindow.t_ms, GovernanceWindow.summary).where(
            GovernanceWindow.cluster == cluster
        )
        return self._newest_first(stmt, GovernanceWindow, since_ms, until_ms, limit)

    def alert_events(
        self,
        cluster: str,
        *,
        since_ms: int | None = None,
        until_ms: int | None = None,
        limit: int | None = None,
        name: str | None = None,
    ) -> list[dict[str, Any]]:
        """Alert transitions of ``cluster`` (of alert ``name``; ``since_ms <= t_ms < until_ms``),
        newest first: dicts with t_ms, name, severity, state and summary."""
        stmt = select(
            AlertEvent.t_ms,
            AlertEvent.name,
            AlertEvent.severity,
            AlertEvent.state,
            AlertEvent.summary,
        ).where(AlertEvent.cluster == cluster)
        if name is not None:
            stmt = stmt.where(AlertEvent.name == name)
        return self._newest_first(stmt, AlertEvent, since_ms, until_ms, limit)

    def firing_alerts(self, cluster: str, *, at_ms: int | None = None) -> list[dict[str, Any]]:
        """The alerts firing at ``at_ms`` (default: now): each alert's newest transition at or
        before it, where that is "firing"."""
        until = None if at_ms is None else at_ms + 1
        with self.database.read() as conn:
            names = (
                conn.execute(
                    select(AlertEvent.name).where(AlertEvent.cluster == cluster).distinct()
                )
                .scalars()
                .all()
            )
        newest = [
            self.alert_events(cluster, until_ms=until, limit=1, name=n) for n in sorted(names)
        ]
        return [e[0] for e in newest if e and e[0]["state"] == "firing"]

    def _newest_first(
        self, stmt: Any, model: Any, since_ms: int | None, until_ms: int | None, limit: int | None
    ) -> list[dict[str, Any]]:
        """The rows of ``stmt`` on a cluster-level table (t_ms, id) in ``[since_ms, until_ms)``,
        newest first, at most ``limit``, as dicts."""
        stmt = in_range(stmt, model.t_ms, since_ms, until_ms).order_by(
            model.t_ms.desc(), model.id.desc()
        )
        if limit is not None:
            stmt = stmt.limit(limit)
        with self.database.read() as conn:
            return [dict(row._mapping) for row in conn.execute(stmt)]

    # ------------------------------------------------------------------ control rows

    def control(self, controller: ControllerName, cluster: str) -> dict[str, Any]:
        """``controller``'s control row of ``cluster`` (cluster, state, paused, who, updated_ms,
        status); the default (dry-run, not paused) when none was written."""
        _check_controller(controller)
        model = ControllerControl
        stmt = select(
            model.cluster, model.state, model.paused, model.who, model.updated_ms, model.status
        ).where(model.cluster == cluster, model.controller == controller)
        with self.database.read() as conn:
            row = conn.execute(stmt).first()
        if row is None:
            return {"cluster": cluster, **CONTROL_DEFAULT}
        return dict(row._mapping)

    def set_control(
        self,
        controller: ControllerName,
        cluster: str,
        *,
        state: str | None = None,
        paused: bool | None = None,
        status: dict[str, Any] | None = None,
        who: str | None = None,
        t_ms: int | None = None,
    ) -> dict[str, Any]:
        """Change ``controller``'s state (``armed`` | ``dry-run`` | ``disarmed``), pause flag or
        status on ``cluster`` (what is not given is kept); returns the row."""
        _check_controller(controller)
        if state is not None and state not in CONTROL_STATES:
            raise ValueError(
                f"{controller} state must be armed, dry-run or disarmed, got {state!r}"
            )
        now = self.database.now_ms() if t_ms is None else t_ms

        given: dict[str, Any] = {"updated_ms": now}
        if state is not None:
            given["state"] = state
        if paused is not None:
            given["paused"] = paused
        if status is not None:
            given["status"] = status
        if who is not None and (state is not None or paused is not None):
            given["who"] = who

        def txn(conn: Connection) -> None:
            # Only the columns given are written: a controller's status every second never puts
            # back a state an operator has just changed.
            doc = {**CONTROL_DEFAULT, **given, "cluster": cluster, "controller": controller}
            conn.execute(
                insert_or_update(
                    conn, table(ControllerControl), ["cluster", "controller"], list(given)
                ),
                [doc],
            )

        self.database.write(txn)
        return self.control(controller, cluster)


def _check_controller(controller: str) -> None:
    if controller not in CONTROLLERS:
        raise ValueError(f"controller must be one of {', '.join(CONTROLLERS)}, got {controller!r}")
