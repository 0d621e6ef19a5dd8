"""per-team spec bytes of unfinished jobs for ``quotas.max_queued_spec_bytes`` (hostile pass B3 of issue #20: 10,000
queued jobs of 1 MiB of argv each stored ~10 GB for one team): on PostgreSQL a ``team_usage.spec_bytes`` column kept
by the statement-level triggers of migration 0007, which now also sum ``octet_length(spec::text)`` (the bytes of the
stored JSON spec, :func:`broker.service.store.quota.spec_bytes`) of the rows that start or stop counting

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

# Insert and delete: the rows that count, their bytes summed per team. Update: only the rows whose counting changes
# (a job that finishes, or moves team, or whose spec changes: spec_hash differs) are joined by id and measured, so the
# planner's updates of many waiting jobs (its decision record) never read their specs (octet_length of json::text
# detoasts the value). A job's id never changes. Counter rows are written in team order, as in 0007. Measured on
# 2 loaded cores (PostgreSQL 15): a 1,000-job COPY 88-91 ms and a single submit ~0.9 ms before and after; an UPDATE
# of 10,400 waiting rows that finishes none 190-200 ms -> 230-245 ms (the join of the transition tables).
_INS = f"""
CREATE OR REPLACE FUNCTION fedbroker_usage_ins() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO team_usage AS u (team, unfinished, spec_bytes)
    SELECT team, count(*), sum(octet_length(spec::text)) FROM new_rows WHERE state NOT IN {_DONE}
    GROUP BY team ORDER BY team
  ON CONFLICT (team) DO UPDATE SET unfinished = u.unfinished + EXCLUDED.unfinished,
                                   spec_bytes = u.spec_bytes + EXCLUDED.spec_bytes;
  RETURN NULL;
END $$"""
_DEL = f"""
CREATE OR REPLACE FUNCTION fedbroker_usage_del() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  UPDATE team_usage AS u SET unfinished = u.unfinished - d.n, spec_bytes = u.spec_bytes - d.b
    FROM (SELECT team, count(*) AS n, sum(octet_length(spec::text)) AS b FROM old_rows
           WHERE state NOT IN {_DONE} GROUP BY team) d
   WHERE u.team = d.team;
  RETURN NULL;
END $$"""
_UPD = f"""
CREATE OR REPLACE FUNCTION fedbroker_usage_upd() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO team_usage AS u (team, unfinished, spec_bytes)
    SELECT team, sum(n), sum(b) FROM (
      SELECT o.team, -1 AS n, -octet_length(o.spec::text)::bigint AS b
        FROM old_rows o JOIN new_rows w ON w.id = o.id
       WHERE o.state NOT IN {_DONE}
         AND (w.state IN {_DONE} OR w.team <> o.team OR w.spec_hash IS DISTINCT FROM o.spec_hash)
      UNION ALL
      SELECT w.team, 1 AS n, octet_length(w.spec::text)::bigint AS b
        FROM old_rows o JOIN new_rows w ON w.id = o.id
       WHERE w.state NOT IN {_DONE}
         AND (o.state IN {_DONE} OR w.team <> o.team OR w.spec_hash IS DISTINCT FROM o.spec_hash)) c
    GROUP BY team HAVING sum(n) <> 0 OR sum(b) <> 0 ORDER BY team
  ON CONFLICT (team) DO UPDATE SET unfinished = u.unfinished + EXCLUDED.unfinished,
                                   spec_bytes = u.spec_bytes + EXCLUDED.spec_bytes;
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
    if op.get_bind().dialect.name != 'postgresql':
        return  # SQLite (single-machine trial): the store sums the team's specs instead (no team_usage table)
    op.add_column('team_usage', sa.Column('spec_bytes', sa.BigInteger(), nullable=False, server_default='0'))
    # the counters must not move between the backfill and the new functions: no job is written meanwhile
    op.execute("LOCK TABLE jobs IN SHARE ROW EXCLUSIVE MODE")
    for sql in (_INS, _DEL, _UPD):
        op.execute(sql)
    op.execute(f"INSERT INTO team_usage AS u (team, unfinished, spec_bytes) "
               f"SELECT team, count(*), sum(octet_length(spec::text)) FROM jobs WHERE state NOT IN {_DONE} "
               f"GROUP BY team ORDER BY team "
               f"ON CONFLICT (team) DO UPDATE SET spec_bytes = EXCLUDED.spec_bytes")


def downgrade() -> None:
    if op.get_bind().dialect.name != 'postgresql':
        return
    for sql in (_INS_0007, _DEL_0007, _UPD_0007):
        op.execute(sql)
    op.drop_column('team_usage', 'spec_bytes')
