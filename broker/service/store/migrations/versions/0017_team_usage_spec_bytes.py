"""per-team spec bytes of unfinished jobs for ``quotas.max_queued_spec_bytes`` (hostile pass B3 of issue #20: 10,000
queued jobs of 1 MiB of argv each stored ~10 GB for one team): on PostgreSQL a ``team_usage.spec_bytes`` column kept
by the statement-level triggers of migration 0007, which now also sum ``octet_length(spec::text)`` (the bytes of the
stored JSON spec, :func:`broker.service.store.quota.spec_bytes`) of the rows that start or stop counting; and a
``team_usage.stored_spec_bytes`` column, the spec bytes of all of the team's stored jobs (finished ones included, out
only when deleted) for ``quotas.stored_spec_bytes``, with an index on ``jobs (team, finished_at)`` for the reconciler
deleting a team's oldest finished jobs over it

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04 12:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

#: the terminal states (broker.states.TERMINAL_STATES), as in 0007; every other state counts against the quotas
_DONE = "('succeeded', 'failed', 'cancelled')"

# Two counters per team: ``spec_bytes``, the specs of its unfinished jobs (``quotas.max_queued_spec_bytes``, checked
# in the submit's transaction), and ``stored_spec_bytes``, the specs of all of its stored jobs, finished ones included
# (``quotas.stored_spec_bytes``, kept by the reconciler deleting the team's oldest finished jobs): a job that finishes
# leaves the first and stays in the second until it is deleted.
# Insert and delete: every row, its bytes summed per team (the unfinished ones also into spec_bytes). Update: only the
# rows whose counting changes (a job that finishes, or moves team, or whose spec changes: spec_hash differs) are joined
# by id and measured, so the planner's updates of many waiting jobs (its decision record) never read their specs
# (octet_length of json::text detoasts the value). A job's id never changes. Counter rows are written in team order,
# as in 0007. Measured on 2 loaded cores (PostgreSQL 15), with spec_bytes alone: a 1,000-job COPY 88-91 ms and a
# single submit ~0.9 ms before and after; an UPDATE of 10,400 waiting rows that finishes none 190-200 ms -> 230-245 ms
# (the join of the transition tables).
_INS = f"""
CREATE OR REPLACE FUNCTION fedbroker_usage_ins() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO team_usage AS u (team, unfinished, spec_bytes, stored_spec_bytes)
    SELECT team, count(*) FILTER (WHERE state NOT IN {_DONE}), coalesce(sum(b) FILTER (WHERE state NOT IN {_DONE}), 0),
           sum(b)
      FROM (SELECT team, state, octet_length(spec::text)::bigint AS b FROM new_rows) r
    GROUP BY team ORDER BY team
  ON CONFLICT (team) DO UPDATE SET unfinished = u.unfinished + EXCLUDED.unfinished,
                                   spec_bytes = u.spec_bytes + EXCLUDED.spec_bytes,
                                   stored_spec_bytes = u.stored_spec_bytes + EXCLUDED.stored_spec_bytes;
  RETURN NULL;
END $$"""
_DEL = f"""
CREATE OR REPLACE FUNCTION fedbroker_usage_del() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  UPDATE team_usage AS u SET unfinished = u.unfinished - d.n, spec_bytes = u.spec_bytes - d.b,
                             stored_spec_bytes = u.stored_spec_bytes - d.sb
    FROM (SELECT team, count(*) FILTER (WHERE state NOT IN {_DONE}) AS n,
                 coalesce(sum(b) FILTER (WHERE state NOT IN {_DONE}), 0) AS b, sum(b) AS sb
            FROM (SELECT team, state, octet_length(spec::text)::bigint AS b FROM old_rows) r
           GROUP BY team) d
   WHERE u.team = d.team;
  RETURN NULL;
END $$"""
# moved: the row's bytes leave its old team's stored count and join its new team's (a new team or a new spec)
_MOVED = "(w.team <> o.team OR w.spec_hash IS DISTINCT FROM o.spec_hash)"
_LEAVES = f"(o.state NOT IN {_DONE} AND (w.state IN {_DONE} OR {_MOVED}))"
_JOINS = f"(w.state NOT IN {_DONE} AND (o.state IN {_DONE} OR {_MOVED}))"
_UPD = f"""
CREATE OR REPLACE FUNCTION fedbroker_usage_upd() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO team_usage AS u (team, unfinished, spec_bytes, stored_spec_bytes)
    SELECT team, sum(n), sum(b), sum(sb) FROM (
      SELECT team, CASE WHEN leaves THEN -1 ELSE 0 END AS n, CASE WHEN leaves THEN -ob ELSE 0 END AS b,
             CASE WHEN moved THEN -ob ELSE 0 END AS sb
        FROM (SELECT o.team, {_LEAVES} AS leaves, {_MOVED} AS moved, octet_length(o.spec::text)::bigint AS ob
                FROM old_rows o JOIN new_rows w ON w.id = o.id WHERE {_LEAVES} OR {_MOVED}) l
      UNION ALL
      SELECT team, CASE WHEN joins THEN 1 ELSE 0 END, CASE WHEN joins THEN nb ELSE 0 END,
             CASE WHEN moved THEN nb ELSE 0 END
        FROM (SELECT w.team, {_JOINS} AS joins, {_MOVED} AS moved, octet_length(w.spec::text)::bigint AS nb
                FROM old_rows o JOIN new_rows w ON w.id = o.id WHERE {_JOINS} OR {_MOVED}) j) c
    GROUP BY team HAVING sum(n) <> 0 OR sum(b) <> 0 OR sum(sb) <> 0 ORDER BY team
  ON CONFLICT (team) DO UPDATE SET unfinished = u.unfinished + EXCLUDED.unfinished,
                                   spec_bytes = u.spec_bytes + EXCLUDED.spec_bytes,
                                   stored_spec_bytes = u.stored_spec_bytes + EXCLUDED.stored_spec_bytes;
  RETURN NULL;
END $$"""

# 0007's functions, put back by the downgrade
_INS_0007 = f"""
CREATE OR REPLACE FUNCTION fedbroker_usage_ins() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO team_usage AS u (team, unfinished)
    SELECT team, count(*) FROM new_rows WHERE state NOT IN {_DONE} GROUP BY team ORDER BY team
  ON CONFLICT (team) DO UPDATE SET unfinished = u.unfinished + EXCLUDED.unfinished;
  RETURN NULL;
END $$"""
_DEL_0007 = f"""
CREATE OR REPLACE FUNCTION fedbroker_usage_del() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  UPDATE team_usage AS u SET unfinished = u.unfinished - d.n
    FROM (SELECT team, count(*) AS n FROM old_rows WHERE state NOT IN {_DONE} GROUP BY team) d
   WHERE u.team = d.team;
  RETURN NULL;
END $$"""
_UPD_0007 = f"""
CREATE OR REPLACE FUNCTION fedbroker_usage_upd() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO team_usage AS u (team, unfinished)
    SELECT team, sum(n) FROM (
      SELECT team, -1 AS n FROM old_rows WHERE state NOT IN {_DONE}
      UNION ALL
      SELECT team, 1 AS n FROM new_rows WHERE state NOT IN {_DONE}) c
    GROUP BY team HAVING sum(n) <> 0 ORDER BY team
  ON CONFLICT (team) DO UPDATE SET unfinished = u.unfinished + EXCLUDED.unfinished;
  RETURN NULL;
END $$"""


def upgrade() -> None:
    # the reconciler's stored-spec budget reads a team's oldest finished jobs (both dialects)
    op.create_index('ix_jobs_team_finished_at', 'jobs', ['team', 'finished_at'])
    if op.get_bind().dialect.name != 'postgresql':
        return  # SQLite (single-machine trial): the store sums the team's specs instead (no team_usage table)
    op.add_column('team_usage', sa.Column('spec_bytes', sa.BigInteger(), nullable=False, server_default='0'))
    op.add_column('team_usage', sa.Column('stored_spec_bytes', sa.BigInteger(), nullable=False, server_default='0'))
    # the counters must not move between the backfill and the new functions: no job is written meanwhile
    op.execute("LOCK TABLE jobs IN SHARE ROW EXCLUSIVE MODE")
    for sql in (_INS, _DEL, _UPD):
        op.execute(sql)
    # unfinished is 0007's (kept as it is on a conflict); a team with only finished jobs gets its row here
    op.execute(f"INSERT INTO team_usage AS u (team, unfinished, spec_bytes, stored_spec_bytes) "
               f"SELECT team, count(*) FILTER (WHERE state NOT IN {_DONE}), "
               f"coalesce(sum(b) FILTER (WHERE state NOT IN {_DONE}), 0), sum(b) "
               f"FROM (SELECT team, state, octet_length(spec::text)::bigint AS b FROM jobs) r "
               f"GROUP BY team ORDER BY team "
               f"ON CONFLICT (team) DO UPDATE SET spec_bytes = EXCLUDED.spec_bytes, "
               f"stored_spec_bytes = EXCLUDED.stored_spec_bytes")


def downgrade() -> None:
    op.drop_index('ix_jobs_team_finished_at', table_name='jobs')
    if op.get_bind().dialect.name != 'postgresql':
        return
    for sql in (_INS_0007, _DEL_0007, _UPD_0007):
        op.execute(sql)
    op.drop_column('team_usage', 'stored_spec_bytes')
    op.drop_column('team_usage', 'spec_bytes')
