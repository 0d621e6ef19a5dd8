"""usage ledger priced like the live planner (issues #12/#13): ``cloud_instances.launch_usd_per_hour`` (the
USD/h the provisioner priced the offer at when it wrote the intent, the ledger's fallback where the live cloud
price cache has no value) and ``usage_records.price_source`` (where a line's price came from)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01 23:40:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('cloud_instances', schema=None) as batch_op:
        batch_op.add_column(sa.Column('launch_usd_per_hour', sa.Float(), nullable=True))
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.add_column(sa.Column('price_source', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.drop_column('price_source')
    with op.batch_alter_table('cloud_instances', schema=None) as batch_op:
        batch_op.drop_column('launch_usd_per_hour')
