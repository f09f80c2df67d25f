"""Multi-tenant governance: per-window figures and alert transitions of a cluster.

* ``governance_windows``: per cluster and window, SCR, JFI, type fairness and the per tenant and
  per type figures (``controlplane.governance.report``).
* ``alert_events``: each governance alert firing (with its severity) or resolving, with the
  value, the threshold and the window's figures.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "governance_windows",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("cluster", sa.String(200), nullable=False),
        sa.Column("t_ms", sa.BigInteger(), nullable=False),
        sa.Column("summary", JSON, nullable=False),
    )
    op.create_index("ix_governance_windows_cluster_t", "governance_windows", ["cluster", "t_ms"])
    op.create_table(
        "alert_events",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("cluster", sa.String(200), nullable=False),
        sa.Column("t_ms", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(50), nullable=False),
        sa.Column("severity", sa.String(20), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("summary", JSON, nullable=False),
    )
    op.create_index("ix_alert_events_cluster_t", "alert_events", ["cluster", "t_ms"])


def downgrade() -> None:
    op.drop_index("ix_alert_events_cluster_t", table_name="alert_events")
    op.drop_table("alert_events")
    op.drop_index("ix_governance_windows_cluster_t", table_name="governance_windows")
    op.drop_table("governance_windows")
