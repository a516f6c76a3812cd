"""tuner decisions: how the realised speedup was measured, and its interval

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 07:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("realised_estimator", sa.String(length=16)),
    ("realised_low", sa.Float()),
    ("realised_high", sa.Float()),
    ("realised_minutes", sa.Integer()),
)


def upgrade() -> None:
    # Realised speedups written before this revision were unpaired (plain steps from the cost window).
    with op.batch_alter_table("tuner_decisions") as batch:
        for name, type_ in COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))
    op.execute("UPDATE tuner_decisions SET realised_estimator = 'unpaired' WHERE realised_speedup IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table("tuner_decisions") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
