"""Fidelity reports: how closely the simulator replayed a replica's recorded traffic.

* ``fidelity_reports``: one row per ``tailpilot fidelity`` run — the replica, the span replayed
  (a ``db:`` URL), and the report (per-window sim vs real figures, their errors, the decision
  diff), so the TUI and ``set --preview`` can show the simulator's error band on that replica.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "fidelity_reports",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("replica_id", sa.Integer(), sa.ForeignKey("replicas.id"), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("span", sa.String(1000), nullable=False),
        sa.Column("summary", JSON, nullable=False),
    )
    op.create_index("ix_fidelity_reports_replica_created", "fidelity_reports", ["replica_id", "created_ms"])


def downgrade() -> None:
    op.drop_index("ix_fidelity_reports_replica_created", table_name="fidelity_reports")
    op.drop_table("fidelity_reports")
