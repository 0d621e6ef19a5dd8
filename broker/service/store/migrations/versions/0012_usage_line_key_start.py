"""usage ledger (issue #12): a line's key also holds its start, so an on-prem node's idle GPU time has one
``idle_amortised`` line per hour (no job, no attempt: the hour tells them apart)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01 22:40:00
"""
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.drop_constraint('uq_usage_records_line', type_='unique')
        batch_op.create_unique_constraint('uq_usage_records_line', ['job_id', 'attempt', 'rank', 'line', 'resource',
                                                                    'start'])


def downgrade() -> None:
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.drop_constraint('uq_usage_records_line', type_='unique')
        batch_op.create_unique_constraint('uq_usage_records_line', ['job_id', 'attempt', 'rank', 'line', 'resource'])
