"""The governor's control row per cluster.

* ``governor_control``: per cluster, whether its governor is armed, dry-run or disarmed, whether
  it is paused, who set that and when, and the governor's own report (active modes, last
  decision), so the TUI and ``tailpilot governor`` steer a governor running in another process.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "governor_control",
        sa.Column("cluster", sa.String(200), primary_key=True),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("who", sa.String(200), nullable=True),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.Column("status", JSON, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("governor_control")
