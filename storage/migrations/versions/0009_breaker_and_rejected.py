"""A replica's circuit-breaker trips and what the collector could not store, per sample.

* ``samples.breaker_trips``: the trips of the replica's circuit breaker since it started (a policy
  that raised inside the engine's step and was replaced); None for replicas that do not report it.
* ``samples.rejected``: the values the collector could not store as the replica sent them, per
  reason (storage.limits.REASONS), since the collector started; NULL when there were none.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-15
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True, astext_type=sa.Text()),
                                               "postgresql")

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("breaker_trips", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("rejected", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("rejected")
        batch.drop_column("breaker_trips")
