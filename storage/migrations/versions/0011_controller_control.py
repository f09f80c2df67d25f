"""One control table for the cluster's controllers.

* ``controller_control``: per cluster and controller (``governor``, ``autopilot``), whether it is
  armed, dry-run or disarmed, whether it is paused, who set that and when, and the controller's
  own report. It replaces ``governor_control`` and ``autopilot_control`` — two tables of one
  shape — and keeps every row they held (downgrade splits them back).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("cluster", "state", "paused", "who", "updated_ms", "status")
_OLD_TABLES = {"governor": "governor_control", "autopilot": "autopilot_control"}


def _columns() -> list[sa.ColumnClause[object]]:
    """The row's columns as read from either shape, ``status`` typed: read untyped, it would come
    back as its JSON text and be encoded a second time on the way in."""
    return [sa.column(c, JSON) if c == "status" else sa.column(c) for c in _COLUMNS]


def _row_columns() -> list[sa.Column[object]]:
    return [
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("who", sa.String(200), nullable=True),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.Column("status", JSON, nullable=True),
    ]


def upgrade() -> None:
    new = op.create_table(
        "controller_control",
        sa.Column("cluster", sa.String(200), primary_key=True),
        sa.Column("controller", sa.String(20), primary_key=True),
        *_row_columns(),
    )
    conn = op.get_bind()
    for controller, old_name in _OLD_TABLES.items():
        old = sa.table(old_name, *_columns())
        rows = [
            {**dict(r._mapping), "controller": controller}
            for r in conn.execute(sa.select(*old.c))
        ]
        if rows:
            op.bulk_insert(new, rows)
        op.drop_table(old_name)


def downgrade() -> None:
    conn = op.get_bind()
    current = sa.table("controller_control", sa.column("controller"), *_columns())
    for controller, old_name in _OLD_TABLES.items():
        old = op.create_table(
            old_name, sa.Column("cluster", sa.String(200), primary_key=True), *_row_columns()
        )
        rows = [
            dict(r._mapping)
            for r in conn.execute(
                sa.select(*(current.c[c] for c in _COLUMNS)).where(
                    current.c.controller == controller
                )
            )
        ]
        if rows:
            op.bulk_insert(old, rows)
    op.drop_table("controller_control")
