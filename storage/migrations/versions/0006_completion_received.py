"""When the engine core received each completion's request.

* ``completions.received_s``: the engine core's receive time (``arrival_s`` is the API server's,
  before tokenising and the hop to the core). A replay starts each request here, so the
  front-end hop is not mistaken for queueing. Nullable: rows stored before this revision, and
  replicas that do not report it, have none (their arrival stands in).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.add_column(sa.Column("received_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.drop_column("received_s")
