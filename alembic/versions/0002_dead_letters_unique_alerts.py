"""dead letters; one alert event per notification

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=True),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("dead_letters", schema=None) as batch_op:
        batch_op.create_index("ix_dead_letters_at", ["at"], unique=False)
    # Duplicates stored by the old check-then-insert race: keep the first of each notification
    # (and move diagnosis links onto it) before the constraint makes them impossible.
    op.execute(
        """
        UPDATE alert_events SET diagnosis_id = (
            SELECT MIN(d.diagnosis_id) FROM alert_events d
            WHERE d.fingerprint = alert_events.fingerprint AND d.status = alert_events.status
              AND d.starts_at = alert_events.starts_at)
        WHERE diagnosis_id IS NULL
        """
    )
    op.execute(
        """
        DELETE FROM alert_events WHERE id NOT IN (
            SELECT MIN(id) FROM alert_events GROUP BY fingerprint, status, starts_at)
        """
    )
    with op.batch_alter_table("alert_events", schema=None) as batch_op:
        batch_op.create_unique_constraint("uq_alert_events_notification", ["fingerprint", "status", "starts_at"])


def downgrade() -> None:
    with op.batch_alter_table("alert_events", schema=None) as batch_op:
        batch_op.drop_constraint("uq_alert_events_notification", type_="unique")
    with op.batch_alter_table("dead_letters", schema=None) as batch_op:
        batch_op.drop_index("ix_dead_letters_at")
    op.drop_table("dead_letters")
