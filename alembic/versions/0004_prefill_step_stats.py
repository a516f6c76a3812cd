"""step statistics count the steps that also prefilled (count, time, tokens generated), which the
tuner charges per generated token; existing rows had none recorded (0)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 10:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("step_stats", schema=None) as batch_op:
        batch_op.add_column(sa.Column("prefill_steps", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("prefill_time_sum_s", sa.Float(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("prefill_generated_tokens", sa.BigInteger(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("step_stats", schema=None) as batch_op:
        batch_op.drop_column("prefill_generated_tokens")
        batch_op.drop_column("prefill_time_sum_s")
        batch_op.drop_column("prefill_steps")
