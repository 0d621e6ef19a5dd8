"""usage ledger (issue #12): usage_records, one row per metered resource of an attempt rank; attempts.meter
(the energy counters read when an on-prem attempt started)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 21:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'usage_records',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('line', sa.String(length=16), nullable=False),
        sa.Column('resource', sa.String(length=100), nullable=False),
        sa.Column('team', sa.String(length=63), nullable=False),
        sa.Column('project', sa.String(length=63), nullable=True),
        sa.Column('start', sa.DateTime(timezone=True), nullable=False),
        sa.Column('end', sa.DateTime(timezone=True), nullable=False),
        sa.Column('provider', sa.String(length=16), nullable=False),
        sa.Column('region', sa.String(length=40), nullable=True),
        sa.Column('zone', sa.String(length=40), nullable=True),
        sa.Column('pool', sa.String(length=63), nullable=True),
        sa.Column('instance_type', sa.String(length=40), nullable=True),
        sa.Column('market', sa.String(length=16), nullable=True),
        sa.Column('gpu_type', sa.String(length=32), nullable=False),
        sa.Column('gpu_count', sa.Integer(), nullable=False),
        sa.Column('run_s', sa.Float(), nullable=False),
        sa.Column('billed_s', sa.Float(), nullable=False),
        sa.Column('list_unit_price_usd', sa.Float(), nullable=True),
        sa.Column('pricing_unit', sa.String(length=16), nullable=False),
        sa.Column('billed_usd', sa.Float(), nullable=True),
        sa.Column('energy_kwh', sa.Float(), nullable=True),
        sa.Column('carbon_kg', sa.Float(), nullable=True),
        sa.Column('estimated', sa.Boolean(), nullable=False),
        sa.Column('estimate_reasons', sa.JSON(), nullable=False),
        sa.Column('source', sa.String(length=8), nullable=False),
        sa.Column('recorded_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_usage_records')),
        sa.UniqueConstraint('job_id', 'attempt', 'rank', 'line', 'resource', name='uq_usage_records_line'))
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_usage_records_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_usage_records_team'), ['team'], unique=False)
        batch_op.create_index(batch_op.f('ix_usage_records_start'), ['start'], unique=False)
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('meter', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_column('meter')
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_usage_records_start'))
        batch_op.drop_index(batch_op.f('ix_usage_records_team'))
        batch_op.drop_index(batch_op.f('ix_usage_records_job_id'))
    op.drop_table('usage_records')
