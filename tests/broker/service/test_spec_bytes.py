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
from sqlalchemy import select, text

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


def stored_all(store: JobStore, team: str) -> tuple[int, int]:
    """``(jobs, spec bytes)`` of all of ``team``'s stored jobs, finished ones included, counted from ``jobs``."""
    with store.session() as s:
        length = ("octet_length(spec::text)" if store.engine.dialect.name == "postgresql"
                  else "length(CAST(spec AS BLOB))")
        n, b = s.execute(text(f"SELECT count(*), coalesce(sum({length}), 0) FROM jobs WHERE team = :t"),
                         {"t": team}).one()
    return int(n), int(b)


def stored_usage(store: JobStore, *teams: str) -> dict[str, int]:
    """team -> team_usage.stored_spec_bytes (triggers, migration 0017)."""
    with store.session() as s:
        rows = s.execute(text("SELECT team, stored_spec_bytes FROM team_usage WHERE team = ANY(:t)"),
                         {"t": list(teams)}).all()
    return {t: int(b) for t, b in rows}


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
        assert stored_usage(pg_store, a, b) == {t: stored_all(pg_store, t)[1] for t in got}  # finished ones too
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
    assert stored_usage(pg_store, a, b) == {a: 0, b: 0}


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
        assert stored_usage(st, team) == {team: 2 * 558 + 1558}  # the finished one too
        st.submit(team, JobSpec.model_validate(SPEC))
        assert usage(st, team) == {team: (3, 2674)}
        assert stored_usage(st, team) == {team: 3 * 558 + 1558}
        _downgrade(st, "0016")  # back to 0007's counters: the job count still follows
        with st.session() as s:
            assert not {"spec_bytes", "stored_spec_bytes"} & {r[0] for r in s.execute(text(
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


# ----------------------------------------------------------------------------- the stored budget
def test_stored_spec_bytes_default_override_and_its_check_against_the_queued_budget():
    assert QuotaSettings().stored_spec_bytes == 1024 ** 3 == 1_073_741_824
    q = QuotaSettings(per_team={"v": TeamQuota(stored_spec_bytes=10_000, max_queued_spec_bytes=10_000),
                                "w": TeamQuota(stored_spec_bytes=0, max_queued_spec_bytes=0)})
    assert (q.for_team("v").stored_spec_bytes, q.for_team("w").stored_spec_bytes) == (10_000, None)
    assert q.for_team("x").stored_spec_bytes == 1_073_741_824
    assert TeamLimits().stored_spec_bytes is None
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match=r"quotas.per_team.v: max_queued_spec_bytes \(10001\) must be set and "
                                              r"at most stored_spec_bytes \(10000\)"):
        QuotaSettings(per_team={"v": TeamQuota(stored_spec_bytes=10_000, max_queued_spec_bytes=10_001)})
    with pytest.raises(ValidationError, match=r"quotas: max_queued_spec_bytes \(unlimited\) must be set and at most "
                                              r"stored_spec_bytes \(1073741824\)"):
        QuotaSettings(max_queued_spec_bytes=0)
    with pytest.raises(ValidationError, match=r"quotas: max_queued_spec_bytes \(268435456\) must be set and at "
                                              r"most stored_spec_bytes \(1000\)"):
        BrokerSettings(quotas={"stored_spec_bytes": 1000})


def _ledger_line(store: JobStore, job_id: str, team: str) -> None:
    from broker.service.store.tables import UsageRow

    t = datetime(2026, 12, 1, tzinfo=UTC)
    with store.session() as s:
        s.add(UsageRow(job_id=job_id, attempt=1, rank=0, line="gpu", resource="V100", team=team, project=None,
                          start=t, end=t + timedelta(hours=1), provider="onprem", gpu_type="V100", gpu_count=1,
                          run_s=3600.0, billed_s=3600.0, pricing_unit="hour", billed_usd=1.5, estimate_reasons=[],
                          recorded_at=t))


def test_a_pass_deletes_the_oldest_finished_jobs_down_to_the_stored_budget(any_store, caplog):
    """Submit-and-cancel past quotas.stored_spec_bytes = 5 B: each pass deletes the team's oldest finished jobs
    (at most retention_batch = 3) until it holds 5 B; its unfinished job, a finished job whose cloud instance is
    live, and another team's jobs stay; the counter follows; the usage ledger stays."""
    from broker.service.store.tables import Attempt, CloudInstance, UsageRow

    store = any_store
    pg = store.engine.dialect.name == "postgresql"
    now = datetime.now(UTC).replace(microsecond=0)
    team, other = new_team(), new_team()
    st = BrokerSettings(retention_batch=3, quotas=QuotaSettings(per_team={
        team: TeamQuota(stored_spec_bytes=5 * B, max_queued_spec_bytes=2 * B)}))
    spec = JobSpec.model_validate(SPEC)
    done = []
    for i in range(8):  # submit, cancel; finished in this order, an hour apart
        jid = store.submit(team, spec, now=now - timedelta(hours=10))[0].id
        assert store.transition(jid, "cancelled", "cancelled by user", finished_at=now - timedelta(hours=9 - i))
        done.append(jid)
    waiting = store.submit(team, spec, now=now - timedelta(hours=10))[0].id  # unfinished, the oldest submit
    theirs = [store.submit(other, spec, now=now - timedelta(hours=20))[0].id for _ in range(3)]
    for jid in theirs:
        assert store.transition(jid, "cancelled", "cancelled", finished_at=now - timedelta(hours=19))
    assert store.append_log(done[0], 1, 0, 0, "line\n")
    _ledger_line(store, done[0], team)
    _ledger_line(store, done[2], team)
    with store.session() as s:
        s.add(Attempt(job_id=done[0], number=1, kind="onprem", pool="local", offer_id=None, nodes=[],
                      gpu_type="V100", gpus=1, created_at=now, rank_exits={}, reason=""))
        s.add(CloudInstance(job_id=done[1], attempt=1, rank=0, offer_id="aws:us-east-1a:p3.2xlarge:spot",
                            provider="aws", region="us-east-1", zone="us-east-1a", instance_type="p3.2xlarge",
                            market="spot", idempotency_token=f"tok-{done[1]}", state="running",
                            created_at=now, updated_at=now, history=[]))
    assert stored_all(store, team) == (9, 9 * B) and stored_all(store, other) == (3, 3 * B)
    if pg:
        assert stored_usage(store, team, other) == {team: 9 * B, other: 3 * B}

    rec = Reconciler(store, st)
    with caplog.at_level("INFO", logger="fedbroker.reconciler"):
        out = rec.run(now)
    # 4 B over: the 4 oldest finished but done[1] (its instance is live), at most 3 this pass
    assert out["spec_budget"] == {"teams_over": 1, "jobs_deleted": 3, "bytes_freed": 3 * B}
    assert out["purged"]["jobs"] == 0  # retention (30 days) deletes none of them
    assert [r.getMessage() for r in caplog.records if "stored spec budget" in r.getMessage()] == [
        f"stored spec budget: team {team!r} held {9 * B} bytes of job specs over its quotas.stored_spec_bytes "
        f"{5 * B}; deleted its 3 oldest finished jobs ({3 * B} bytes); still over, the next pass goes on"]
    left = {j.id for j in store.list_jobs(team=team, limit=100)}
    assert left == {done[1], *done[4:], waiting}
    assert stored_all(store, team) == (6, 6 * B)
    if pg:
        assert stored_usage(store, team, other) == {team: 6 * B, other: 3 * B}
    assert store.events(done[0]) == [] and store.log_chunks(done[0], 1) == [] and store.attempts(done[0]) == []

    assert rec.run(now)["spec_budget"] == {"teams_over": 1, "jobs_deleted": 1, "bytes_freed": B}  # done[4]
    assert {j.id for j in store.list_jobs(team=team, limit=100)} == {done[1], *done[5:], waiting}
    assert stored_all(store, team) == (5, 5 * B)
    assert rec.run(now)["spec_budget"] == {"teams_over": 0, "jobs_deleted": 0, "bytes_freed": 0}  # within: 5 B
    assert {j.id for j in store.list_jobs(team=other, limit=100)} == set(theirs)
    if pg:
        assert stored_usage(store, team, other) == {team: 5 * B, other: 3 * B}
        assert usage(store, team) == {team: (1, B)}  # the queued budget: the waiting job alone
    with store.session() as s:  # the ledger keeps the deleted jobs' lines (finance)
        assert sorted(s.execute(select(UsageRow.job_id).where(UsageRow.team == team)).scalars()) == sorted(
            [done[0], done[2]])


# ----------------------------------------------------------------------------- what one answer carries
def test_a_jobs_page_ends_at_api_list_max_bytes_and_the_sdk_follows_it(pg_store):
    """Hostile pass of 2026-12-04 (second): one member's ``GET /v1/jobs?limit=1000`` over ~390 jobs of 2.75 MB specs
    was a 342 MiB answer that held the API 8.6-11 s and 2 GB. With a budget of 3 B + 1 bytes, a page of 5 jobs
    of B bytes each (newest first) holds 3; ``X-Next-Offset`` says 3; the next page holds the last 2, with no header.
    One job bigger than the budget is still served, alone."""
    from broker.client import Client
    from tests.broker.harness import ServerThread

    team = new_team()
    ids = [pg_store.submit(team, JobSpec(**SPEC))[0].id for _ in range(5)]
    newest = ids[::-1]
    st = BrokerSettings.model_construct(api_list_max_bytes=3 * B + 1)
    with TestClient(create_app(pg_store, st)) as c:
        h = auth(create_token(pg_store, team, "member", label="t").token)
        r = c.get("/v1/jobs", params={"limit": 5}, headers=h)
        assert r.status_code == 200 and [j["id"] for j in r.json()] == newest[:3]
        assert r.headers["X-Next-Offset"] == "3"
        r = c.get("/v1/jobs", params={"limit": 5, "offset": 3}, headers=h)
        assert [j["id"] for j in r.json()] == newest[3:] and "X-Next-Offset" not in r.headers
        r = c.get("/v1/jobs", params={"limit": 3}, headers=h)  # a full page not cut by bytes: no header
        assert len(r.json()) == 3 and "X-Next-Offset" not in r.headers
        huge = pg_store.submit(team, JobSpec(**big(10 * B)))[0].id
        r = c.get("/v1/jobs", params={"limit": 5}, headers=h)
        assert [j["id"] for j in r.json()] == [huge] and r.headers["X-Next-Offset"] == "1"
    # the SDK's list follows the header up to its limit
    with ServerThread(create_app(pg_store, st)) as srv:
        sdk = Client(srv.url, token=h["Authorization"][7:])
        assert [j.id for j in sdk.list(limit=6)] == [huge, *newest]
        assert [j.id for j in sdk.list(limit=2)] == [huge, newest[0]]


def test_a_schedule_spec_over_64_kib_is_refused_naming_the_field(pg_store):
    team = new_team()
    with TestClient(create_app(pg_store, BrokerSettings.model_construct())) as c:
        h = auth(create_token(pg_store, team, "member", label="t").token)
        body = {"name": "big", "cron": "@daily", "spec": big(64 * 1024)}
        r = c.post("/v1/schedules", json=body, headers=h)
        assert r.status_code == 422, r.text
        # B + 65,536 + 4 bytes, less 4: the spec is checked as given, with the default team "default" (7 characters)
        assert [(e["loc"], e["msg"]) for e in r.json()["detail"]] == [(["body", "spec", "command"], (
            "spec.command: 2 arguments make the spec 66094 bytes as stored; a schedule's spec holds at most 65536 "
            "(put a long command in a script in the image)"))]
        assert pg_store.schedules(team) == []
        ok = {"name": "fits", "cron": "@daily", "spec": big(60 * 1024)}
        assert c.post("/v1/schedules", json=ok, headers=h).status_code == 201

