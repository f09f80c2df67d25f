"""Replica instances and the settings they ran.

* ``collector_cursors.instance``: the replica incarnation (the plugin's /state ``instance``) a
  cursor counts in, so a replica restarted while no collector ran is read again from cursor 0.
* ``settings_seen``: each replica's settings document whenever the collector sees a new version or
  instance, whoever made the change, so a replay shows the parameters in force at any time.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("collector_cursors") as batch:
        batch.add_column(sa.Column("instance", sa.String(64), nullable=True))
    op.create_table(
        "settings_seen",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("replica_id", sa.Integer(), nullable=False),
        sa.Column("t_ms", sa.BigInteger(), nullable=False),
        sa.Column("instance", sa.String(64), nullable=True),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("settings", JSON, nullable=False),
        sa.ForeignKeyConstraint(["replica_id"], ["replicas.id"], name=op.f("fk_settings_seen_replica_id_replicas")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_settings_seen")),
    )
    op.create_index("ix_settings_seen_replica_t", "settings_seen", ["replica_id", "t_ms"])


def downgrade() -> None:
    op.drop_index("ix_settings_seen_replica_t", table_name="settings_seen")
    op.drop_table("settings_seen")
    with op.batch_alter_table("collector_cursors") as batch:
        batch.drop_column("instance")
