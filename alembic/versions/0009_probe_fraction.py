"""policies: the share of a switched-off class's requests that still speculate is `probe_fraction`
(the policy called it `exploration_fraction`, the engine's settings `probe_fraction`)

Rewrites the stored policy documents, current and every version (a rollback validates an old
version's body against today's schema), in the global policy and every class and instance override.
The audit trail is left as it was written.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 17:00:00
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD, NEW = "exploration_fraction", "probe_fraction"
_JSON = sa.JSON().with_variant(JSONB(astext_type=sa.Text()), "postgresql")
TABLES = [
    sa.table("policies", sa.column("scope", sa.String), sa.column("body", _JSON)),
    sa.table(
        "policy_versions", sa.column("scope", sa.String), sa.column("version", sa.Integer), sa.column("body", _JSON)
    ),
]


def renamed(body: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """A copy of ``body`` with the field ``old`` named ``new`` in its global policy and every override."""
    out = copy.deepcopy(body)
    overrides = [o for group in ("classes", "instances") for o in (out.get(group) or {}).values()]
    for policy in [out.get("global"), *overrides]:
        if isinstance(policy, dict) and old in policy:
            policy[new] = policy.pop(old)
    return out


def _rename(old: str, new: str) -> None:
    conn = op.get_bind()
    for table in TABLES:
        keys = [c for c in table.c if c.name != "body"]
        for row in conn.execute(sa.select(*keys, table.c.body)).all():
            if isinstance(row.body, dict) and (changed := renamed(row.body, old, new)) != row.body:
                where = sa.and_(*(key == getattr(row, key.name) for key in keys))
                conn.execute(sa.update(table).where(where).values(body=changed))


def upgrade() -> None:
    _rename(OLD, NEW)


def downgrade() -> None:
    _rename(NEW, OLD)
