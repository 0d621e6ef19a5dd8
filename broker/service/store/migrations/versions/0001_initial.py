"""initial job store schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 17:33:54.980127
"""
from alembic import op
import sqlalchemy as sa



revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table('api_tokens',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('team', sa.String(length=63), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('admin', sa.Boolean(), nullable=False),
    sa.Column('label', sa.String(length=200), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked', sa.Boolean(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_api_tokens_token_hash'))
    )
    op.create_table('jobs',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('team', sa.String(length=63), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=True),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('spec_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('not_before', sa.DateTime(timezone=True), nullable=True),
    sa.Column('not_after', sa.DateTime(timezone=True), nullable=True),
    sa.Column('deadline', sa.DateTime(timezone=True), nullable=False),
    sa.Column('review_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('committed_pool', sa.String(length=63), nullable=True),
    sa.Column('deferred_once', sa.Boolean(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('decision', sa.JSON(), nullable=True),
    sa.Column('placement', sa.JSON(), nullable=True),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('state_deadline_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('stop_reason', sa.String(length=32), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('work_done_s', sa.Float(), nullable=False),
    sa.Column('schedule_id', sa.String(length=40), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs')),
    sa.UniqueConstraint('team', 'idempotency_key', name='uq_jobs_team_idempotency_key')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_state'), ['state'], unique=False)
        batch_op.create_index('ix_jobs_state_priority_created', ['state', 'priority', 'created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_team'), ['team'], unique=False)

    op.create_table('nodes',
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('pool', sa.String(length=63), nullable=False),
    sa.Column('gpu_type', sa.String(length=32), nullable=False),
    sa.Column('gpu_count', sa.Integer(), nullable=False),
    sa.Column('gpu_memory_gb', sa.Float(), nullable=False),
    sa.Column('healthy_gpus', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('agent_id', sa.String(length=64), nullable=False),
    sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_heartbeat_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('telemetry', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_nodes'))
    )
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_nodes_pool'), ['pool'], unique=False)

    op.create_table('planner_state',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('version', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('leader', sa.String(length=200), nullable=False),
    sa.Column('cycle_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_planner_state'))
    )
    op.create_table('schedules',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('team', sa.String(length=63), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('cron', sa.String(length=200), nullable=False),
    sa.Column('timezone', sa.String(length=64), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('enabled', sa.Boolean(), nullable=False),
    sa.Column('next_fire_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_fire_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_schedules')),
    sa.UniqueConstraint('team', 'name', name='uq_schedules_team_name')
    )
    with op.batch_alter_table('schedules', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_schedules_team'), ['team'], unique=False)

    op.create_table('attempts',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=8), nullable=False),
    sa.Column('pool', sa.String(length=63), nullable=True),
    sa.Column('offer_id', sa.String(length=200), nullable=True),
    sa.Column('nodes', sa.JSON(), nullable=False),
    sa.Column('gpu_type', sa.String(length=32), nullable=True),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('rank_exits', sa.JSON(), nullable=False),
    sa.Column('outcome', sa.String(length=16), nullable=True),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_attempts_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_attempts')),
    sa.UniqueConstraint('job_id', 'number', name='uq_attempts_job_number')
    )
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_attempts_job_id'), ['job_id'], unique=False)

    op.create_table('cloud_instances',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('offer_id', sa.String(length=200), nullable=False),
    sa.Column('provider', sa.String(length=16), nullable=False),
    sa.Column('region', sa.String(length=40), nullable=False),
    sa.Column('zone', sa.String(length=40), nullable=False),
    sa.Column('instance_type', sa.String(length=40), nullable=False),
    sa.Column('market', sa.String(length=16), nullable=False),
    sa.Column('idempotency_token', sa.String(length=64), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('provider_instance_id', sa.String(length=100), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('history', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_cloud_instances_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_cloud_instances')),
    sa.UniqueConstraint('idempotency_token', name=op.f('uq_cloud_instances_idempotency_token'))
    )
    with op.batch_alter_table('cloud_instances', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_cloud_instances_job_id'), ['job_id'], unique=False)

    op.create_table('job_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_events_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_events'))
    )
    with op.batch_alter_table('job_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_events_job_id'), ['job_id'], unique=False)

    op.create_table('job_logs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('data', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_logs_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_logs')),
    sa.UniqueConstraint('job_id', 'attempt', 'rank', 'seq', name='uq_job_logs_chunk')
    )

    op.execute("INSERT INTO planner_state (id, version, leader) VALUES (1, 0, '')")


def downgrade() -> None:

    op.drop_table('job_logs')
    with op.batch_alter_table('job_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_events_job_id'))

    op.drop_table('job_events')
    with op.batch_alter_table('cloud_instances', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cloud_instances_job_id'))

    op.drop_table('cloud_instances')
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_attempts_job_id'))

    op.drop_table('attempts')
    with op.batch_alter_table('schedules', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_schedules_team'))

    op.drop_table('schedules')
    op.drop_table('planner_state')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_nodes_pool'))

    op.drop_table('nodes')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_team'))
        batch_op.drop_index('ix_jobs_state_priority_created')
        batch_op.drop_index(batch_op.f('ix_jobs_state'))

    op.drop_table('jobs')
    op.drop_table('api_tokens')

