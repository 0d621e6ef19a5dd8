"""instance report replay protection: the last report sequence number per cloud instance (rank)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 14:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('cloud_instances', schema=None) as batch_op:
        batch_op.add_column(sa.Column('report_seq', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('cloud_instances', schema=None) as batch_op:
        batch_op.drop_column('report_seq')
