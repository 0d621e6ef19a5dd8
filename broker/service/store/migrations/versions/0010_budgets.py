"""team budgets (issue #12 item 4): budgets, one row per team with a monthly cloud cap and a soft alert fraction

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 21:30:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'budgets',
        sa.Column('team', sa.String(length=63), nullable=False),
        sa.Column('cap_usd', sa.Float(), nullable=False),
        sa.Column('alert_fraction', sa.Float(), nullable=False),
        sa.Column('alerted_month', sa.String(length=7), nullable=True),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_by', sa.String(length=63), nullable=False),
        sa.PrimaryKeyConstraint('team', name=op.f('pk_budgets')))


def downgrade() -> None:
    op.drop_table('budgets')
