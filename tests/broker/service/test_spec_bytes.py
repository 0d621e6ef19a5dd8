"""The per-team budget of stored spec bytes (``quotas.max_queued_spec_bytes``; hostile pass B3 of issue #20: a member
could store 10,000 queued jobs of 1 MiB of argv each, ~10 GB). Real PostgreSQL (and the SQLite trial store).

Hand-checked sizes: a spec is counted as the bytes of its stored JSON (``json.dumps`` of ``model_dump(mode="json")``,
:func:`broker.service.store.quota.spec_bytes`). ``SPEC`` below with an 11-character team (``t`` + 10 hex digits) and
no name is B = 558 bytes: ``"name": null`` and the 22 other fields as Python writes them. Replacing
``["/bin/true"]`` by ``["/bin/echo", "x" * n]`` (``/bin/echo`` is as long as ``/bin/true``) adds ``, "`` + n + ``"``:
n + 4 bytes. ``RUN`` (the schedule's spec, ``"name": "tick"``) is 2 bytes more than SPEC: 560.
"""

from __future__ import annotations

import uuid
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import text

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from broker.model import JobSpec
from broker.service.api import create_app
from broker.service.limits import QuotaExceeded
from broker.service.reconciler import Reconciler
from broker.service.settings import BrokerSettings, QuotaSettings, TeamLimits, TeamQuota
from broker.service.store.core import JobStore, SubmitItem
from broker.service.store.quota import spec_bytes
from broker.service.store.tables import Job
from broker.service.tokens import create_token
from broker.states import TERMINAL_STATES
from tests.conftest import PG_URL, auth

UTC = timezone.utc
SPEC = {"command": ["/bin/true"], "gpus_per_node": 1, "estimated_duration_s": 60}
B = 558  # SPEC's bytes as stored for an 11-character team (module docstring)
MIB = 1024 ** 2


def big(n: int) -> dict:
    """SPEC with a command of ``n`` more argv bytes: B + n + 4 bytes stored."""
    return {**SPEC, "command": ["/bin/echo", "x" * n]}


def new_team() -> str:
    return "t" + uuid.uuid4().hex[:10]


def stored_bytes(store: JobStore, team: str) -> tuple[int, int]:
    """``(unfinished jobs, their spec bytes)`` of ``team`` counted from ``jobs`` (not from team_usage)."""
    with store.session() as s:
        if store.engine.dialect.name == "postgresql":
            n, b = s.execute(text("SELECT count(*), coalesce(sum(octet_length(spec::text)), 0) FROM jobs "
                                  "WHERE team = :t AND state NOT IN ('succeeded', 'failed', 'cancelled')"),
                             {"t": team}).one()
        else:
            n, b = s.execute(text("SELECT count(*), coalesce(sum(length(CAST(spec AS BLOB))), 0) FROM jobs "
                                  "WHERE team = :t AND state NOT IN ('succeeded', 'failed', 'cancelled')"),
                             {"t": team}).one()
    return int(n), int(b)


def usage(store: JobStore, *teams: str) -> dict[str, tuple[int, int]]:
    """team -> ``(unfinished, spec_bytes)`` as the triggers keep them in team_usage."""
    with store.session() as s:
        rows = s.execute(text("SELECT team, unfinished, spec_bytes FROM team_usage WHERE team = ANY(:t)"),
                         {"t": list(teams)}).all()
    return {t: (n, b) for t, n, b in rows}


def client(store: JobStore, quotas: QuotaSettings) -> TestClient:
    return TestClient(create_app(store, BrokerSettings.model_construct(quotas=quotas)))


# ----------------------------------------------------------------------------- settings
def test_default_and_per_team_override():
    assert QuotaSettings().max_queued_spec_bytes == 256 * MIB == 268_435_456
    q = QuotaSettings(max_queued_spec_bytes=10_000, per_team={"vision": TeamQuota(max_queued_spec_bytes=0,
                                                                                  stored_spec_bytes=0),
                                                              "nlp": TeamQuota(max_queued_spec_bytes=5_000)})
    assert q.for_team("other").max_queued_spec_bytes == 10_000
    assert q.for_team("vision").max_queued_spec_bytes is None  # 0 = unlimited
    assert q.for_team("nlp").max_queued_spec_bytes == 5_000
    assert QuotaSettings(max_queued_spec_bytes=None, stored_spec_bytes=None).for_team("x").max_queued_spec_bytes is None
    assert TeamLimits().max_queued_spec_bytes is None


def test_spec_bytes_is_the_stored_json():
    team = "t0123456789"
    assert spec_bytes(JobSpec.model_validate({**SPEC, "team": team}).model_dump(mode="json")) == B
    assert spec_bytes(JobSpec.model_validate({**big(1000), "team": team}).model_dump(mode="json")) == B + 1004
    # non-ASCII is written as \uXXXX: "é" is 6 bytes stored ("\u00e9"), and "null" -> "\"\u00e9\"" adds 4
    assert spec_bytes(JobSpec.model_validate({**SPEC, "team": team, "name": "é"}).model_dump(mode="json")) == B + 4


# ----------------------------------------------------------------------------- the API refuses
def test_a_small_budget_refuses_the_next_submit_with_the_exact_detail(pg_store):
    team = new_team()
    h = auth(create_token(pg_store, team, label="test").token)
    budget = 2 * B + 100  # 1,216: two SPECs (1,116) fit, a third (1,674) does not
    with client(pg_store, QuotaSettings(max_queued_spec_bytes=budget, submits_per_s=0)) as c:
        a = c.post("/v1/jobs", json={"spec": SPEC, "idempotency_key": "a"}, headers=h)
        assert a.status_code == 201, a.text
        assert c.post("/v1/jobs", json={"spec": SPEC}, headers=h).status_code == 201
        assert usage(pg_store, team) == {team: (2, 2 * B)} and stored_bytes(pg_store, team) == (2, 1116)
        r = c.post("/v1/jobs", json={"spec": SPEC}, headers=h)
        assert (r.status_code, r.headers["Retry-After"]) == (429, "30")
        assert r.json() == {
            "detail": f"quotas.max_queued_spec_bytes: team {team!r} may hold 1216 bytes of unfinished jobs' specs and "
                      f"holds 1116; this submit (558 bytes) would exceed it (retry after 30 s, or cancel jobs; a "
                      f"spec's bytes are its stored JSON)",
            "limit": "quotas.max_queued_spec_bytes", "retry_after_s": 30}
        assert usage(pg_store, team) == {team: (2, 1116)}  # nothing stored, the counter rolled back
        # an idempotent replay of an existing job is answered at the budget
        again = c.post("/v1/jobs", json={"spec": SPEC, "idempotency_key": "a"}, headers=h)
        assert (again.status_code, again.json()["id"]) == (200, a.json()["id"])
        # a finished job frees its bytes: 1116 - 558 = 558 held, room for 658 = big(96) (558 + 96 + 4) exactly
        assert c.post(f"/v1/jobs/{a.json()['id']}/cancel", headers=h).json()["state"] == "cancelled"
        assert usage(pg_store, team) == {team: (1, B)}
        assert c.post("/v1/jobs", json={"spec": big(96)}, headers=h).status_code == 201  # 558 + 658 = 1216: fits
        assert usage(pg_store, team) == {team: (2, 1216)} == {team: stored_bytes(pg_store, team)}
        r = c.post("/v1/jobs", json={"spec": big(0)}, headers=h)  # B + 4 = 562 more
        assert r.json()["detail"].startswith(f"quotas.max_queued_spec_bytes: team {team!r} may hold 1216 bytes of "
                                             f"unfinished jobs' specs and holds 1216; this submit (562 bytes)")
        # the batch: refused whole, nothing stored, the detail names the new jobs and their bytes
        r = c.post("/v1/jobs:batch", json={"items": [{"spec": SPEC}] * 3}, headers=h)
        assert (r.status_code, r.json()["limit"]) == (429, "quotas.max_queued_spec_bytes")
        assert r.json()["detail"].startswith(f"quotas.max_queued_spec_bytes: team {team!r} may hold 1216 bytes of "
                                             f"unfinished jobs' specs and holds 1216; these 3 jobs (1674 bytes) would "
                                             f"exceed it")
    assert stored_bytes(pg_store, team) == (2, 1216)
    assert len(pg_store.list_jobs(team=team, limit=10)) == 3  # a, the second SPEC, big(96)


def test_the_job_count_is_checked_before_the_bytes(pg_store):
    team = new_team()
    spec = JobSpec.model_validate(SPEC)
    pg_store.submit(team, spec, max_unfinished=1, max_spec_bytes=B)
    with pytest.raises(QuotaExceeded) as e:  # over both: the job quota is named
        pg_store.submit(team, spec, max_unfinished=1, max_spec_bytes=B)
    assert e.value.limit == "quotas.max_queued_jobs"
    with pytest.raises(QuotaExceeded) as e:
        pg_store.submit(team, spec, max_unfinished=5, max_spec_bytes=B)
    assert e.value.limit == "quotas.max_queued_spec_bytes"
    assert pg_store.submit(team, spec, max_unfinished=5, max_spec_bytes=None)[1] is True  # unlimited


def test_per_team_override_through_the_api(pg_store):
    small, free, other = new_team(), new_team(), new_team()
    quotas = QuotaSettings(max_queued_spec_bytes=B, submits_per_s=0,  # one SPEC per team by default
                           per_team={small: TeamQuota(max_queued_spec_bytes=B - 1),  # not even one
                                     free: TeamQuota(max_queued_spec_bytes=0, stored_spec_bytes=0)})  # unlimited
    with client(pg_store, quotas) as c:
        codes = {t: [c.post("/v1/jobs", json={"spec": SPEC}, headers=auth(create_token(pg_store, t).token)).status_code
                     for _ in range(3)] for t in (small, free, other)}
    assert codes == {small: [429] * 3, free: [201] * 3, other: [201, 429, 429]}
    assert usage(pg_store, small, free, other) == {free: (3, 3 * B), other: (1, B)}


def test_the_group_commit_and_batch_store_paths(pg_store):
    team, calm = new_team(), new_team()
    spec = JobSpec.model_validate(SPEC)
    # a group over one team's budget is given up and each item answered alone: the first fits, the second not
    out = pg_store.submit_group([SubmitItem(team, spec, max_spec_bytes=B + 10, quota_retry_after_s=7)] * 2
                                + [SubmitItem(calm, spec, max_spec_bytes=B)])
    assert [r[1] if isinstance(r, tuple) else r.limit for r in out] == [True, "quotas.max_queued_spec_bytes", True]
    assert str(out[1]).startswith(f"quotas.max_queued_spec_bytes: team {team!r} may hold {B + 10} bytes of unfinished "
                                  f"jobs' specs and holds {B}; this submit ({B} bytes) would exceed it (retry after 7 s")
    # a group within budget is stored in one go
    assert pg_store.submit_writer().try_group([SubmitItem(team, spec, max_spec_bytes=10 * B)]) is not None
    # submit_many: replays add nothing, so a batch of replays and one new job needs only the new job's bytes
    first = pg_store.submit_many(calm, [(spec, "k1", None)], max_spec_bytes=3 * B)
    again = pg_store.submit_many(calm, [(spec, "k1", None), (spec, "k2", None)], max_spec_bytes=3 * B)
    assert [c for _, c in again] == [False, True] and again[0][0].id == first[0][0].id
    with pytest.raises(QuotaExceeded, match=rf"holds {3 * B}; this submit \({B} bytes\) would exceed it"):
        pg_store.submit_many(calm, [(spec, "k1", None), (spec, "k3", None)], max_spec_bytes=3 * B)
    assert usage(pg_store, team, calm) == {team: (2, 2 * B), calm: (3, 3 * B)}


def test_sqlite_sums_the_same_bytes(sqlite_store):
    team = "t0123456789"
    sqlite_store.submit(team, JobSpec.model_validate(big(1000)), max_spec_bytes=B + 1004)
    assert stored_bytes(sqlite_store, team) == (1, B + 1004)
    with pytest.raises(QuotaExceeded) as e:
        sqlite_store.submit(team, JobSpec.model_validate(SPEC), max_spec_bytes=B + 1004)
    assert str(e.value).startswith(f"quotas.max_queued_spec_bytes: team {team!r} may hold 1562 bytes of unfinished "
                                   f"jobs' specs and holds 1562; this submit (558 bytes)")
    with pytest.raises(QuotaExceeded, match=r"these 2 jobs \(1116 bytes\)"):
        sqlite_store.submit_many(team, [(JobSpec.model_validate(SPEC), None, None)] * 2, max_spec_bytes=2 * B + 1004)
    assert stored_bytes(sqlite_store, team) == (1, 1562)


# ----------------------------------------------------------------------------- the counter
def test_team_usage_spec_bytes_follow_every_change(pg_store):
    """team_usage.spec_bytes (triggers, migration 0017) equals a sum over the jobs after inserts, transitions,
    updates that finish nothing, bulk updates over two teams, a spec rewritten, a team moved, and deletes."""
    mig = (Path(__file__).parents[3] / "broker/service/store/migrations/versions/0017_team_usage_spec_bytes.py")
    assert "_DONE = \"('succeeded', 'failed', 'cancelled')\"" in mig.read_text()
    assert {s.value for s in TERMINAL_STATES} == {"succeeded", "failed", "cancelled"}
    a, b = new_team(), new_team()

    def both() -> dict:
        got = usage(pg_store, a, b)
        assert got == {t: v for t in (a, b) if (v := stored_bytes(pg_store, t)) != (0, 0) or t in got}
        return got

    small, large = JobSpec.model_validate(SPEC), JobSpec.model_validate(big(996))  # 558 and 1,558 bytes
    jobs = [pg_store.submit(a, small)[0], pg_store.submit(a, large)[0], pg_store.submit(a, small)[0]]
    pg_store.submit_many(b, [(large, None, None)] * 4)  # COPY
    assert both() == {a: (3, 2674), b: (4, 6232)}
    pg_store.request_cancel(jobs[1].id)  # the large one finishes
    assert pg_store.transition(jobs[0].id, "queued", "test")  # not a finish: no change
    with pg_store.session() as s:  # the planner's kind of update: many waiting rows, nothing finishes
        s.execute(Job.__table__.update().where(Job.team.in_([a, b])).values(reason="waiting"))
    assert both() == {a: (2, 1116), b: (4, 6232)}
    with pg_store.session() as s:  # one statement over both teams finishes the submitted ones
        s.execute(Job.__table__.update().where(Job.team.in_([a, b]), Job.state == "submitted").values(state="failed"))
    assert both() == {a: (1, 558), b: (0, 0)}
    with pg_store.session() as s:  # a spec rewritten (its hash with it): counted at its new size
        s.execute(Job.__table__.update().where(Job.id == jobs[0].id).values(
            spec=large.model_copy(update={"team": a}).model_dump(mode="json"), spec_hash="rewritten"))
    assert both() == {a: (1, 1558), b: (0, 0)}
    with pg_store.session() as s:  # a job moved to the other team
        s.execute(Job.__table__.update().where(Job.id == jobs[0].id).values(team=b))
    assert both() == {a: (0, 0), b: (1, 1558)}
    with pg_store.session() as s:
        s.execute(Job.__table__.delete().where(Job.team.in_([a, b])))
    assert usage(pg_store, a, b) == {a: (0, 0), b: (0, 0)}


def test_migration_0017_backfills_and_downgrades():
    st = JobStore(PG_URL, schema=f"t_{uuid.uuid4().hex[:12]}")
    try:
        st.migrate("0016")
        team = new_team()
        st.submit(team, JobSpec.model_validate(SPEC))
        st.submit(team, JobSpec.model_validate(big(996)))
        done = st.submit(team, JobSpec.model_validate(SPEC))[0]
        st.request_cancel(done.id)  # finished: not counted
        st.migrate()
        assert usage(st, team) == {team: (2, 558 + 1558)}
        st.submit(team, JobSpec.model_validate(SPEC))
        assert usage(st, team) == {team: (3, 2674)}
        _downgrade(st, "0016")  # back to 0007's counters: the job count still follows
        with st.session() as s:
            assert "spec_bytes" not in {r[0] for r in s.execute(text(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'team_usage' "
                "AND table_schema = current_schema()"))}
        st.submit(team, JobSpec.model_validate(SPEC))
        with st.session() as s:
            assert s.execute(text("SELECT unfinished FROM team_usage WHERE team = :t"), {"t": team}).scalar() == 4
        st.migrate()
        assert usage(st, team) == {team: (4, 3232)}
    finally:
        st.drop_schema()


def _downgrade(st: JobStore, revision: str) -> None:
    """Alembic downgrade of ``st`` to ``revision`` (as :meth:`JobStore.migrate` upgrades)."""
    from alembic import command
    from alembic.config import Config

    from broker.service.store.core import MIGRATIONS_DIR

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with st.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


# ----------------------------------------------------------------------------- schedules
def test_a_fire_over_the_spec_bytes_is_skipped_with_its_reason(pg_store):
    t0 = datetime(2026, 12, 4, 3, 0, tzinfo=UTC)
    fire = t0 + timedelta(seconds=60)
    team = new_team()
    run = JobSpec.model_validate({**SPEC, "name": "tick"})  # 560 bytes
    st = BrokerSettings(quotas=QuotaSettings(per_team={team: TeamQuota(max_queued_spec_bytes=B + 559)}))
    sid = pg_store.create_schedule(team, "tick", "* * * * *", "UTC", run, now=t0).id
    pg_store.submit(team, JobSpec.model_validate(SPEC), now=t0)  # 558 held: 560 more is 1,118 > 1,117
    out = Reconciler(pg_store, st).run(fire)
    assert (out["scheduled"], out["schedule_skips"]) == (0, 1)
    assert pg_store.get_schedule(sid).last_skip_reason == (
        f"fire at 2026-12-04T03:01:00+00:00 skipped: quotas.max_queued_spec_bytes: team {team!r} may hold 1117 bytes "
        f"of unfinished jobs' specs and holds 558; this submit (560 bytes) would exceed it (retry after 30 s, or cancel "
        f"jobs; a spec's bytes are its stored JSON)")
    assert usage(pg_store, team) == {team: (1, 558)}
