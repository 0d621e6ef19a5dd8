"""no team floods the others (issue #20 item 3): a schedule's last skipped fire (``last_skip_at``,
``last_skip_reason``: over the team's queued-jobs quota or priority entitlement), and the UTF-8 size of every
stored log chunk (``job_logs.bytes``) that the per-team log byte budget sums, with an index by job

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 03:40:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('schedules') as b:
        b.add_column(sa.Column('last_skip_at', sa.DateTime(timezone=True), nullable=True))
        b.add_column(sa.Column('last_skip_reason', sa.Text(), nullable=True))
    with op.batch_alter_table('job_logs') as b:
        b.add_column(sa.Column('bytes', sa.Integer(), nullable=False, server_default='0'))
        b.add_column(sa.Column('dropped_bytes', sa.BigInteger(), nullable=False, server_default='0'))
    # chunks stored before this revision: their size now (octet_length on PostgreSQL, length of the blob on SQLite)
    if op.get_bind().dialect.name == 'postgresql':
        op.execute("UPDATE job_logs SET bytes = octet_length(data)")
    else:
        op.execute("UPDATE job_logs SET bytes = length(CAST(data AS BLOB))")


def downgrade() -> None:
    with op.batch_alter_table('job_logs') as b:
        b.drop_column('dropped_bytes')
        b.drop_column('bytes')
    with op.batch_alter_table('schedules') as b:
        b.drop_column('last_skip_reason')
        b.drop_column('last_skip_at')
