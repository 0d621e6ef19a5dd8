"""cloud instance state history: one row per state change of a cloud_instances row (broker.instance_states)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 17:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'cloud_instance_events',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('instance_row_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('from_state', sa.String(length=16), nullable=True),
        sa.Column('to_state', sa.String(length=16), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(['instance_row_id'], ['cloud_instances.id'],
                                name=op.f('fk_cloud_instance_events_instance_row_id_cloud_instances'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_cloud_instance_events')))
    with op.batch_alter_table('cloud_instance_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_cloud_instance_events_instance_row_id'), ['instance_row_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_cloud_instance_events_job_id'), ['job_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('cloud_instance_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cloud_instance_events_job_id'))
        batch_op.drop_index(batch_op.f('ix_cloud_instance_events_instance_row_id'))
    op.drop_table('cloud_instance_events')
