"""per-team unfinished-job counters for the queued-jobs quota: index jobs (team, state); on PostgreSQL
a team_usage table kept by statement-level triggers on jobs

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 14:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

#: the terminal states (broker.states.TERMINAL_STATES); every other state counts against the quota
_DONE = "('succeeded', 'failed', 'cancelled')"


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_team_state', ['team', 'state'], unique=False)
    if op.get_bind().dialect.name != 'postgresql':
        return  # SQLite (single-machine trial): the store counts the team's jobs instead
    op.create_table('team_usage',
                    sa.Column('team', sa.String(length=63), nullable=False),
                    sa.Column('unfinished', sa.Integer(), nullable=False, server_default='0'),
                    sa.PrimaryKeyConstraint('team', name='pk_team_usage'))
    # one function per operation; each runs once per statement over its transition tables, so a
    # 1,000-row insert costs one upsert per team, and an update that finishes no job changes nothing;
    # counter rows are locked in team order (no deadlock between two multi-team statements)
    op.execute(f"""
CREATE FUNCTION fedbroker_usage_ins() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO team_usage AS u (team, unfinished)
    SELECT team, count(*) FROM new_rows WHERE state NOT IN {_DONE} GROUP BY team ORDER BY team
  ON CONFLICT (team) DO UPDATE SET unfinished = u.unfinished + EXCLUDED.unfinished;
  RETURN NULL;
END $$""")
    op.execute(f"""
CREATE FUNCTION fedbroker_usage_del() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  UPDATE team_usage AS u SET unfinished = u.unfinished - d.n
    FROM (SELECT team, count(*) AS n FROM old_rows WHERE state NOT IN {_DONE} GROUP BY team) d
   WHERE u.team = d.team;
  RETURN NULL;
END $$""")
    op.execute(f"""
CREATE FUNCTION fedbroker_usage_upd() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO team_usage AS u (team, unfinished)
    SELECT team, sum(n) FROM (
      SELECT team, -1 AS n FROM old_rows WHERE state NOT IN {_DONE}
      UNION ALL
      SELECT team, 1 AS n FROM new_rows WHERE state NOT IN {_DONE}) c
    GROUP BY team HAVING sum(n) <> 0 ORDER BY team
  ON CONFLICT (team) DO UPDATE SET unfinished = u.unfinished + EXCLUDED.unfinished;
  RETURN NULL;
END $$""")
    op.execute("CREATE TRIGGER jobs_usage_ins AFTER INSERT ON jobs REFERENCING NEW TABLE AS new_rows "
               "FOR EACH STATEMENT EXECUTE FUNCTION fedbroker_usage_ins()")
    op.execute("CREATE TRIGGER jobs_usage_del AFTER DELETE ON jobs REFERENCING OLD TABLE AS old_rows "
               "FOR EACH STATEMENT EXECUTE FUNCTION fedbroker_usage_del()")
    op.execute("CREATE TRIGGER jobs_usage_upd AFTER UPDATE ON jobs REFERENCING OLD TABLE AS old_rows "
               "NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION fedbroker_usage_upd()")
    op.execute(f"INSERT INTO team_usage (team, unfinished) SELECT team, count(*) FROM jobs "
               f"WHERE state NOT IN {_DONE} GROUP BY team")


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        for t in ('ins', 'del', 'upd'):
            op.execute(f"DROP TRIGGER IF EXISTS jobs_usage_{t} ON jobs")
            op.execute(f"DROP FUNCTION IF EXISTS fedbroker_usage_{t}()")
        op.drop_table('team_usage')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_team_state')
