"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 13:37:09.617727
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('audit_entries',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('action', sa.String(length=64), nullable=False),
    sa.Column('scope', sa.String(length=160), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('diff', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('audit_entries', schema=None) as batch_op:
        batch_op.create_index('ix_audit_entries_at', ['at'], unique=False)

    op.create_table('diagnostics_reports',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('trigger', sa.String(length=32), nullable=False),
    sa.Column('prompt_class', sa.String(length=32), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('summary', sa.Text(), nullable=True),
    sa.Column('report', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('diagnostics_reports', schema=None) as batch_op:
        batch_op.create_index('ix_diagnostics_reports_created', ['created_at'], unique=False)

    op.create_table('engine_instances',
    sa.Column('instance_id', sa.String(length=128), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('method', sa.String(length=32), nullable=False),
    sa.Column('capacity', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('degraded_reason', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('instance_id')
    )
    op.create_table('policies',
    sa.Column('scope', sa.String(length=160), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('body', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_by', sa.String(length=128), nullable=False),
    sa.PrimaryKeyConstraint('scope')
    )
    op.create_table('policy_versions',
    sa.Column('scope', sa.String(length=160), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('body', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.PrimaryKeyConstraint('scope', 'version')
    )
    op.create_table('request_records',
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('instance_id', sa.String(length=128), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('prompt_class', sa.String(length=32), nullable=False),
    sa.Column('arrival_time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('first_token_time', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finish_time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('output_tokens', sa.Integer(), nullable=False),
    sa.Column('ttft_s', sa.Float(), nullable=True),
    sa.Column('tpot_s', sa.Float(), nullable=True),
    sa.Column('e2e_s', sa.Float(), nullable=False),
    sa.Column('speculation_method', sa.String(length=32), nullable=False),
    sa.Column('speculation_enabled', sa.Boolean(), nullable=False),
    sa.Column('num_speculative_tokens', sa.Integer(), nullable=False),
    sa.Column('settings_version', sa.Integer(), nullable=False),
    sa.Column('num_spec_steps', sa.Integer(), nullable=False),
    sa.Column('num_draft_tokens', sa.Integer(), nullable=False),
    sa.Column('num_accepted_tokens', sa.Integer(), nullable=False),
    sa.Column('drafted_per_position', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('accepted_per_position', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('batch_size_mean', sa.Float(), nullable=True),
    sa.Column('batch_size_max', sa.Integer(), nullable=True),
    sa.Column('finish_reason', sa.String(length=16), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('request_id')
    )
    with op.batch_alter_table('request_records', schema=None) as batch_op:
        batch_op.create_index('ix_request_records_finish', ['finish_time'], unique=False)
        batch_op.create_index('ix_request_records_instance_class_finish', ['instance_id', 'prompt_class', 'finish_time'], unique=False)

    op.create_table('request_rollups',
    sa.Column('instance_id', sa.String(length=128), nullable=False),
    sa.Column('prompt_class', sa.String(length=32), nullable=False),
    sa.Column('num_speculative_tokens', sa.Integer(), nullable=False),
    sa.Column('minute', sa.DateTime(timezone=True), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('errors', sa.Integer(), nullable=False),
    sa.Column('output_tokens', sa.BigInteger(), nullable=False),
    sa.Column('num_spec_steps', sa.BigInteger(), nullable=False),
    sa.Column('num_draft_tokens', sa.BigInteger(), nullable=False),
    sa.Column('num_accepted_tokens', sa.BigInteger(), nullable=False),
    sa.Column('drafted_per_position', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('accepted_per_position', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('ttft_s_sum', sa.Float(), nullable=False),
    sa.Column('e2e_s_sum', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('instance_id', 'prompt_class', 'num_speculative_tokens', 'minute')
    )
    op.create_table('sampled_prompts',
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('prompt_class', sa.String(length=32), nullable=False),
    sa.Column('prompt', sa.Text(), nullable=False),
    sa.Column('completion', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('request_id')
    )
    with op.batch_alter_table('sampled_prompts', schema=None) as batch_op:
        batch_op.create_index('ix_sampled_prompts_class_expires', ['prompt_class', 'expires_at'], unique=False)

    op.create_table('step_stats',
    sa.Column('instance_id', sa.String(length=128), nullable=False),
    sa.Column('minute', sa.DateTime(timezone=True), nullable=False),
    sa.Column('batch_bucket', sa.Integer(), nullable=False),
    sa.Column('num_speculative_tokens', sa.Integer(), nullable=False),
    sa.Column('writer', sa.String(length=32), nullable=False),
    sa.Column('steps', sa.Integer(), nullable=False),
    sa.Column('step_time_sum_s', sa.Float(), nullable=False),
    sa.Column('step_time_p50_s', sa.Float(), nullable=False),
    sa.Column('step_time_p95_s', sa.Float(), nullable=False),
    sa.Column('batch_size_sum', sa.BigInteger(), nullable=False),
    sa.Column('scheduled_tokens', sa.BigInteger(), nullable=False),
    sa.Column('num_draft_tokens', sa.BigInteger(), nullable=False),
    sa.Column('num_accepted_tokens', sa.BigInteger(), nullable=False),
    sa.Column('accepted_per_position', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.PrimaryKeyConstraint('instance_id', 'minute', 'batch_bucket', 'num_speculative_tokens', 'writer')
    )
    op.create_table('tuner_decisions',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('instance_id', sa.String(length=128), nullable=False),
    sa.Column('prompt_class', sa.String(length=32), nullable=False),
    sa.Column('batch_bucket', sa.Integer(), nullable=True),
    sa.Column('mode', sa.String(length=16), nullable=False),
    sa.Column('action', sa.String(length=32), nullable=False),
    sa.Column('n_before', sa.Integer(), nullable=False),
    sa.Column('n_after', sa.Integer(), nullable=False),
    sa.Column('predicted_speedup', sa.Float(), nullable=True),
    sa.Column('realised_speedup', sa.Float(), nullable=True),
    sa.Column('inputs', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('applied', sa.Boolean(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('tuner_decisions', schema=None) as batch_op:
        batch_op.create_index('ix_tuner_decisions_instance_class_at', ['instance_id', 'prompt_class', 'at'], unique=False)

    op.create_table('alert_events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('alertname', sa.String(length=128), nullable=False),
    sa.Column('labels', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('starts_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('diagnosis_id', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['diagnosis_id'], ['diagnostics_reports.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('alert_events', schema=None) as batch_op:
        batch_op.create_index('ix_alert_events_received', ['received_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('alert_events', schema=None) as batch_op:
        batch_op.drop_index('ix_alert_events_received')

    op.drop_table('alert_events')
    with op.batch_alter_table('tuner_decisions', schema=None) as batch_op:
        batch_op.drop_index('ix_tuner_decisions_instance_class_at')

    op.drop_table('tuner_decisions')
    op.drop_table('step_stats')
    with op.batch_alter_table('sampled_prompts', schema=None) as batch_op:
        batch_op.drop_index('ix_sampled_prompts_class_expires')

    op.drop_table('sampled_prompts')
    op.drop_table('request_rollups')
    with op.batch_alter_table('request_records', schema=None) as batch_op:
        batch_op.drop_index('ix_request_records_instance_class_finish')
        batch_op.drop_index('ix_request_records_finish')

    op.drop_table('request_records')
    op.drop_table('policy_versions')
    op.drop_table('policies')
    op.drop_table('engine_instances')
    with op.batch_alter_table('diagnostics_reports', schema=None) as batch_op:
        batch_op.drop_index('ix_diagnostics_reports_created')

    op.drop_table('diagnostics_reports')
    with op.batch_alter_table('audit_entries', schema=None) as batch_op:
        batch_op.drop_index('ix_audit_entries_at')

    op.drop_table('audit_entries')
