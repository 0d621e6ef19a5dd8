"""index on jobs.finished_at for the reconciler's retention pass

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 14:00:00
"""
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_finished_at', ['finished_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_finished_at')
