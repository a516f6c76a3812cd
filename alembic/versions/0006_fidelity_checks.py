"""fidelity checks: audited greedy requests compared with their plain replay

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 08:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "fidelity_checks",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("instance_id", sa.String(length=128), nullable=False),
        sa.Column("prompt_class", sa.String(length=32), nullable=False),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("speculation_method", sa.String(length=16), nullable=False),
        sa.Column("num_speculative_tokens", sa.Integer(), nullable=False),
        sa.Column("result", sa.String(length=16), nullable=False),
        sa.Column("compared_tokens", sa.Integer(), nullable=False),
        sa.Column("diverged_at", sa.Integer(), nullable=True),
        sa.Column("served_margin", sa.Float(), nullable=True),
        sa.Column("plain_margin", sa.Float(), nullable=True),
        sa.Column("served_gap", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("request_id"),
    )
    op.create_index("ix_fidelity_checks_class_checked", "fidelity_checks", ["prompt_class", "checked_at"])


def downgrade() -> None:
    op.drop_index("ix_fidelity_checks_class_checked", table_name="fidelity_checks")
    op.drop_table("fidelity_checks")
