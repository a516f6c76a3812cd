"""tuner leader lease with epochs; decisions carry the epoch that made them; instances report the
settings version they hold and their draft; one rebuild slot for rolling changes

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 20:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tuner_leases",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "rebuild_slots",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    with op.batch_alter_table("tuner_decisions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("leader_epoch", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("engine_instances", schema=None) as batch_op:
        batch_op.add_column(sa.Column("draft_model", sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column("settings_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engine_instances", schema=None) as batch_op:
        batch_op.drop_column("settings_version")
        batch_op.drop_column("draft_model")
    with op.batch_alter_table("tuner_decisions", schema=None) as batch_op:
        batch_op.drop_column("leader_epoch")
    op.drop_table("rebuild_slots")
    op.drop_table("tuner_leases")
