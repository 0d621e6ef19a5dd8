"""Retention (issue #9 item 7): the reconciler deletes jobs finished more than ``retention_days`` ago with
their events, logs, attempts and cloud-instance records, in bounded batches; PostgreSQL and SQLite. Audit
retention (issue #20 B8): audit events older than ``audit_retention_days`` go the same way."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, insert, select, update

from broker.service.store.tables import Attempt, AuditEvent, CloudInstance, Job, JobEvent, JobLog, utcnow
from broker.model import JobSpec
from broker.service.reconciler import Reconciler
from broker.service.settings import BrokerSettings

PATHS = {"succeeded": ["queued", "starting", "running", "succeeded"], "failed": ["queued", "failed"],
         "cancelled": ["cancelled"], "queued": ["queued"]}


def _job(store, state, finished_at=None, attempts=0, logs=0, instance=None, created=None):
    """A job of team ml moved along PATHS[state] (events: 1 + len(path)), with ``attempts`` attempt rows,
    ``logs`` log chunks of attempt 1 and optionally a cloud instance record in state ``instance``."""
    jid = store.submit("ml", JobSpec(command=["true"]), now=created or finished_at or utcnow())[0].id
    for to in PATHS[state]:
        fields = {"finished_at": finished_at} if to in ("succeeded", "failed", "cancelled") else {}
        assert store.transition(jid, to, f"to {to}", **fields)
    with store.session() as s:
        for n in range(1, attempts + 1):
            s.add(Attempt(job_id=jid, number=n, kind="onprem", pool="local", offer_id=None, nodes=[], gpu_type="V100",
                          gpus=1, created_at=finished_at, rank_exits={}, reason=""))
        if instance is not None:
            s.add(CloudInstance(job_id=jid, attempt=1, rank=0, offer_id="aws:us-east-1a:p3.2xlarge:spot",
                                provider="aws", region="us-east-1", zone="us-east-1a", instance_type="p3.2xlarge",
                                market="spot", idempotency_token=f"tok-{jid}", state=instance,
                                created_at=finished_at, updated_at=finished_at, history=[]))
    for seq in range(logs):
        assert store.append_log(jid, 1, 0, seq, f"line {seq}\n")
    return jid


def _counts(store) -> dict[str, int]:
    with store.session() as s:
        return {k: s.execute(select(func.count()).select_from(t)).scalar_one()
                for k, t in (("jobs", Job), ("events", JobEvent), ("logs", JobLog), ("attempts", Attempt),
                             ("cloud_instances", CloudInstance))}


def test_finished_jobs_are_purged_after_retention_days_in_batches(any_store):
    store = any_store
    now = utcnow()
    old = now - timedelta(days=40)
    a = _job(store, "succeeded", old - timedelta(days=3), attempts=1, logs=3)  # 5 events
    b = _job(store, "failed", old - timedelta(days=2))  # 3 events
    c = _job(store, "cancelled", old - timedelta(days=1), attempts=1, instance="terminated")  # 2 events
    d = _job(store, "cancelled", old, attempts=1, instance="running")  # an instance still live: kept
    e = _job(store, "succeeded", now - timedelta(days=10), attempts=1, logs=2)  # finished 10 days ago: kept
    f = _job(store, "queued", created=old)  # old but not finished: kept
    assert _counts(store) == {"jobs": 6, "events": 5 + 3 + 2 + 2 + 5 + 2, "logs": 5, "attempts": 4,
                              "cloud_instances": 2}
    rec = Reconciler(store, BrokerSettings(retention_days=30, retention_batch=2))
    out = rec.run(now)
    assert out["purged"] == {"jobs": 2, "events": 8, "logs": 3, "attempts": 1, "cloud_instances": 0}  # a, b: oldest
    assert out["changed"] == 0
    assert rec.run(now)["purged"] == {"jobs": 1, "events": 2, "logs": 0, "attempts": 1, "cloud_instances": 1}  # c
    assert rec.run(now)["purged"] == {"jobs": 0, "events": 0, "logs": 0, "attempts": 0, "cloud_instances": 0}
    with store.session() as s:  # d's instance is terminated at last: d goes in the next pass
        s.execute(update(CloudInstance).where(CloudInstance.job_id == d).values(state="terminated"))
    assert rec.run(now)["purged"] == {"jobs": 1, "events": 2, "logs": 0, "attempts": 1, "cloud_instances": 1}
    assert _counts(store) == {"jobs": 2, "events": 5 + 2, "logs": 2, "attempts": 1, "cloud_instances": 0}
    assert sorted(j.id for j in store.list_jobs()) == sorted([e, f])
    assert [ev.to_state for ev in store.events(e)] == ["submitted", "queued", "starting", "running", "succeeded"]
    assert store.log_chunks(e, 1) == [(0, "line 0\n"), (1, "line 1\n")]
    assert store.events(a) == [] and store.log_chunks(a, 1) == [] and store.attempts(c) == []
    # ten days later e is 20 days past... still kept at 30; at 41 days it goes
    assert rec.run(now + timedelta(days=10))["purged"]["jobs"] == 0
    assert rec.run(now + timedelta(days=21))["purged"] == {"jobs": 1, "events": 5, "logs": 2, "attempts": 1,
                                                           "cloud_instances": 0}
    assert [j.id for j in store.list_jobs()] == [f]


def test_retention_days_zero_keeps_everything(any_store):
    store = any_store
    now = utcnow()
    _job(store, "succeeded", now - timedelta(days=3650), attempts=1, logs=1)
    before = _counts(store)
    rec = Reconciler(store, BrokerSettings(retention_days=0))
    out = rec.run(now)
    assert "purged" not in out
    assert rec.purge_finished(now) == {"jobs": 0, "events": 0, "logs": 0, "attempts": 0, "cloud_instances": 0}
    assert _counts(store) == before == {"jobs": 1, "events": 5, "logs": 1, "attempts": 1, "cloud_instances": 0}


def test_retention_settings_are_bounded():
    import pytest
    from pydantic import ValidationError

    st = BrokerSettings()
    assert (st.retention_days, st.retention_batch, st.intake_batch, st.intake_per_cycle) == (30.0, 500, 250, 200)
    assert (st.audit_retention_days, st.audit_retention_batch) == (400.0, 5000)
    for bad in ({"retention_days": -1}, {"retention_batch": 0}, {"intake_batch": 0}, {"intake_per_cycle": -1},
                {"audit_retention_days": -1}, {"audit_retention_days": 36_501}, {"audit_retention_batch": 0},
                {"audit_retention_batch": 100_001}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            BrokerSettings(**bad)


# ----------------------------------------------------------------------------- audit retention (issue #20 B8)
def _audit_rows(store, ats) -> list[int]:
    """One ``job.cancel`` audit event per instant of ``ats`` (in that order); their ids."""
    from broker.service.store.tokens import audit_row

    with store.session() as s:
        return [s.execute(insert(AuditEvent).values(**audit_row(None, "job.cancel", f"job-{i:016x}", {"n": i}, at))
                          .returning(AuditEvent.id)).scalar_one() for i, at in enumerate(ats)]


def _audit_ids(store) -> list[int]:
    with store.session() as s:
        return sorted(s.execute(select(AuditEvent.id)).scalars())


def test_audit_events_older_than_audit_retention_days_are_purged_in_batches(pg_store):
    store = pg_store
    now = utcnow()
    cutoff = now - timedelta(days=400)
    ids = _audit_rows(store, [cutoff - timedelta(days=100), now, cutoff - timedelta(seconds=1),  # 0, 2: old
                              cutoff,  # exactly at the cutoff: kept
                              cutoff - timedelta(microseconds=1),  # 4: old
                              cutoff + timedelta(microseconds=1), now - timedelta(days=30)])  # kept
    rec = Reconciler(store, BrokerSettings(retention_days=30, audit_retention_batch=2))
    out = rec.run(now)
    assert out["audit_purged"] == 2  # the two oldest: 0 then 2
    assert _audit_ids(store) == [ids[1], ids[3], ids[4], ids[5], ids[6]]
    assert rec.run(now)["audit_purged"] == 1  # 4, a microsecond before the cutoff
    assert rec.run(now)["audit_purged"] == 0
    assert _audit_ids(store) == [ids[1], ids[3], ids[5], ids[6]]
    assert rec.purge_audit(now + timedelta(microseconds=1)) == 1  # a microsecond later the cutoff row goes
    assert _audit_ids(store) == [ids[1], ids[5], ids[6]]
    # job retention is off: audit retention still runs (they are independent)
    rec = Reconciler(store, BrokerSettings(retention_days=0, audit_retention_days=1))
    out = rec.run(now)
    assert "purged" not in out and out["audit_purged"] == 2  # 5 and 6; the row at now stays
    assert _audit_ids(store) == [ids[1]]


def test_audit_retention_batch_bounds_each_pass(pg_store):
    store = pg_store
    now = utcnow()
    old = now - timedelta(days=401)
    ids = _audit_rows(store, [old - timedelta(seconds=i) for i in range(25)] + [now] * 3)
    rec = Reconciler(store, BrokerSettings(audit_retention_batch=10))
    assert [rec.run(now)["audit_purged"] for _ in range(4)] == [10, 10, 5, 0]
    keep = ids[25:]
    assert _audit_ids(store) == keep
    # oldest first: ids[i] is i seconds older than ids[0], so one batch of 10 takes ids[15:25]
    ids = _audit_rows(store, [old - timedelta(seconds=i) for i in range(25)])
    assert rec.purge_audit(now) == 10
    assert _audit_ids(store) == keep + ids[:15]


def test_audit_retention_days_zero_keeps_every_event(any_store):
    store = any_store
    now = utcnow()
    ids = _audit_rows(store, [now - timedelta(days=36_000), now - timedelta(days=401), now])
    rec = Reconciler(store, BrokerSettings(audit_retention_days=0))
    out = rec.run(now)
    assert "audit_purged" not in out
    assert rec.purge_audit(now) == 0
    assert _audit_ids(store) == ids


def test_audit_retention_on_sqlite(sqlite_store):
    now = utcnow()
    ids = _audit_rows(sqlite_store, [now - timedelta(days=500), now - timedelta(days=401), now - timedelta(days=399)])
    rec = Reconciler(sqlite_store, BrokerSettings(audit_retention_batch=1))
    assert [rec.run(now)["audit_purged"] for _ in range(3)] == [1, 1, 0]
    assert _audit_ids(sqlite_store) == ids[2:]
