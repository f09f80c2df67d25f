"""The autopilot's control row per cluster.

* ``autopilot_control``: per cluster, whether its autopilot is armed, dry-run or disarmed, whether
  it is paused, who set that and when, and the autopilot's own report (per replica its choice, why,
  and its last decisions), so the TUI and ``tailpilot autopilot`` steer an autopilot running in
  another process (``tailpilot record --autopilot``). Shaped as ``governor_control``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "autopilot_control",
        sa.Column("cluster", sa.String(200), primary_key=True),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("who", sa.String(200), nullable=True),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.Column("status", JSON, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("autopilot_control")
