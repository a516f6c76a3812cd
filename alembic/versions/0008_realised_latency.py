"""tuner decisions: time to first token and per output token of the setting against plain

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Decisions closed before this revision keep no latency: their spans' records may be gone.
    with op.batch_alter_table("tuner_decisions") as batch:
        batch.add_column(
            sa.Column(
                "realised_latency", sa.JSON().with_variant(JSONB(astext_type=sa.Text()), "postgresql"), nullable=True
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("tuner_decisions") as batch:
        batch.drop_column("realised_latency")
