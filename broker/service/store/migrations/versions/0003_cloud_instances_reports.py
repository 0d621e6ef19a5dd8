"""cloud instance reports, private address and failover history

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 20:20:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('planner_state', schema=None) as batch_op:
        batch_op.add_column(sa.Column('instance_secret', sa.String(length=64), nullable=True))
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('failover', sa.JSON(), nullable=True))
    with op.batch_alter_table('cloud_instances', schema=None) as batch_op:
        batch_op.add_column(sa.Column('private_ip', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('last_report_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('last_event', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('error', sa.Text(), nullable=True))
        batch_op.create_index('ix_cloud_instances_state', ['state'], unique=False)
        batch_op.create_index('ix_cloud_instances_updated_at', ['updated_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('cloud_instances', schema=None) as batch_op:
        batch_op.drop_index('ix_cloud_instances_updated_at')
        batch_op.drop_index('ix_cloud_instances_state')
        for c in ('error', 'last_event', 'last_report_at', 'private_ip'):
            batch_op.drop_column(c)
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_column('failover')
    with op.batch_alter_table('planner_state', schema=None) as batch_op:
        batch_op.drop_column('instance_secret')
