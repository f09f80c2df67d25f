"""The client's cap on each completion.

* ``completions.max_tokens``: the request's ``max_tokens`` as the replica reported it, so a
  recording replayed as a trace carries the real cap instead of one made from the output length.
  Nullable: rows stored before this revision, and replicas that do not report it, have none.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.add_column(sa.Column("max_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.drop_column("max_tokens")
