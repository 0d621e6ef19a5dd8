"""token kinds, lifetimes, public ids and last use; the audit log

Existing tokens: ``kind`` = ``admin`` where ``admin`` was set, else ``member``; ``public_id`` a fresh
``tok-<16 hex>``; ``expires_at`` = the migration instant + 90 days (the default ``token_ttl_days``),
so every token has an expiry (rotate them before then: ``fedbroker tokens rotate TOKEN_ID``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 14:00:00
"""
import uuid
from datetime import datetime, timedelta, timezone

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

#: lifetime given to tokens that existed before this revision (the default of settings.token_ttl_days)
LEGACY_TTL = timedelta(days=90)


def upgrade() -> None:
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('public_id', sa.String(length=20), nullable=True))
        batch_op.add_column(sa.Column('kind', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('node', sa.String(length=63), nullable=True))
    conn = op.get_bind()
    tokens = sa.table('api_tokens', sa.column('id', sa.Integer), sa.column('admin', sa.Boolean),
                      sa.column('public_id', sa.String), sa.column('kind', sa.String),
                      sa.column('expires_at', sa.DateTime(timezone=True)))
    expires = datetime.now(timezone.utc) + LEGACY_TTL
    if conn.dialect.name == 'sqlite':  # stored as the UtcDateTime type stores it: naive UTC text
        expires = expires.replace(tzinfo=None)
    for row in conn.execute(sa.select(tokens.c.id, tokens.c.admin)).all():
        conn.execute(tokens.update().where(tokens.c.id == row.id).values(
            public_id='tok-' + uuid.uuid4().hex[:16], kind='admin' if row.admin else 'member', expires_at=expires))
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.alter_column('public_id', existing_type=sa.String(length=20), nullable=False)
        batch_op.alter_column('kind', existing_type=sa.String(length=16), nullable=False)
        batch_op.alter_column('expires_at', existing_type=sa.DateTime(timezone=True), nullable=False)
        batch_op.create_unique_constraint('uq_api_tokens_public_id', ['public_id'])
    op.create_table(
        'audit_events',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('actor_token_id', sa.String(length=40), nullable=True),
        sa.Column('actor_team', sa.String(length=63), nullable=False),
        sa.Column('actor_kind', sa.String(length=16), nullable=False),
        sa.Column('action', sa.String(length=40), nullable=False),
        sa.Column('target', sa.String(length=200), nullable=False),
        sa.Column('detail', sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_audit_events')),
    )
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.create_index('ix_audit_events_at', ['at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.drop_index('ix_audit_events_at')
    op.drop_table('audit_events')
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.drop_constraint('uq_api_tokens_public_id', type_='unique')
        for c in ('node', 'last_used_at', 'expires_at', 'kind', 'public_id'):
            batch_op.drop_column(c)
