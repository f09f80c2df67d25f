"""Predictions kept with applied changes (``tailpilot set --preview``), for ``tailpilot verify``.

* ``predictions``: per replica and applied change (its settings version), when it was applied and
  the what-if summary: the settings before and after, the window and the predicted figures.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "predictions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("replica_id", sa.Integer(), sa.ForeignKey("replicas.id"), nullable=False),
        sa.Column("t_ms", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("summary", JSON, nullable=False),
    )
    op.create_index("ix_predictions_replica_t", "predictions", ["replica_id", "t_ms"])


def downgrade() -> None:
    op.drop_index("ix_predictions_replica_t", table_name="predictions")
    op.drop_table("predictions")
