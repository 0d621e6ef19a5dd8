"""project budgets (issue #12 item 4): project_budgets, one row per (team, project) with a monthly cloud cap and
a soft alert fraction, beside the team budgets of 0010

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01 23:50:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'project_budgets',
        sa.Column('team', sa.String(length=63), nullable=False),
        sa.Column('project', sa.String(length=63), nullable=False),
        sa.Column('cap_usd', sa.Float(), nullable=False),
        sa.Column('alert_fraction', sa.Float(), nullable=False),
        sa.Column('alerted_month', sa.String(length=7), nullable=True),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_by', sa.String(length=63), nullable=False),
        sa.PrimaryKeyConstraint('team', 'project', name=op.f('pk_project_budgets')))


def downgrade() -> None:
    op.drop_table('project_budgets')
