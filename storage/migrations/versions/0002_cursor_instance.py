"""Collector cursors remember the replica instance they count in (the plugin's /state "instance"),
so a replica restarted while no collector ran is read again from cursor 0.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("collector_cursors") as batch:
        batch.add_column(sa.Column("instance", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("collector_cursors") as batch:
        batch.drop_column("instance")
