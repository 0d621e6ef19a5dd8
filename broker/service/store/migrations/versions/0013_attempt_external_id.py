"""attempts on an existing scheduler's pool (issue #14): attempts.external_id (the Slurm job id of the attempt),
attempts.kind up to 16 characters (onprem | cloud | slurm | kubernetes)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01 23:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.alter_column('kind', existing_type=sa.String(length=8), type_=sa.String(length=16),
                              existing_nullable=False)
        batch_op.add_column(sa.Column('external_id', sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_column('external_id')
        batch_op.alter_column('kind', existing_type=sa.String(length=16), type_=sa.String(length=8),
                              existing_nullable=False)
