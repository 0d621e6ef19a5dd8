"""index jobs (team, state): the per-team queued-jobs quota counts a team's unfinished jobs

Revision ID: 0007
Revises: 0003
Create Date: 2026-12-01 14:00:00
"""
from alembic import op

revision = '0007'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_team_state', ['team', 'state'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_team_state')
