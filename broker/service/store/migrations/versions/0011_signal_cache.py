"""live signals (issue #13 item 2): signal_values (the durable copy of the signal cache) and signal_fetches

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 22:40:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'signal_values',
        sa.Column('source', sa.String(length=40), nullable=False),
        sa.Column('zone', sa.String(length=64), nullable=False),
        sa.Column('hour_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('kind', sa.String(length=8), nullable=False),
        sa.Column('value', sa.Float(), nullable=False),
        sa.Column('unit', sa.String(length=16), nullable=False),
        sa.Column('estimated', sa.Boolean(), nullable=False),
        sa.Column('forecast', sa.Boolean(), nullable=False),
        sa.Column('fetched_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('source', 'zone', 'hour_at', name=op.f('pk_signal_values')))
    op.create_index('ix_signal_values_zone_kind_hour', 'signal_values', ['zone', 'kind', 'hour_at'])
    op.create_table(
        'signal_fetches',
        sa.Column('source', sa.String(length=40), nullable=False),
        sa.Column('zone', sa.String(length=64), nullable=False),
        sa.Column('kind', sa.String(length=8), nullable=False),
        sa.Column('last_attempt_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('last_success_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('last_error', sa.String(length=500), nullable=False),
        sa.Column('error_counts', sa.JSON(), nullable=False),
        sa.Column('stale_after_s', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('source', 'zone', 'kind', name=op.f('pk_signal_fetches')))


def downgrade() -> None:
    op.drop_table('signal_fetches')
    op.drop_index('ix_signal_values_zone_kind_hour', table_name='signal_values')
    op.drop_table('signal_values')
