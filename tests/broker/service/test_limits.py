"""Per-team limits (broker.service.limits) and the bulk submit (POST /v1/jobs:batch), through FastAPI's
TestClient on a real PostgreSQL schema and a real Redis (``FEDBROKER_TEST_REDIS``)."""

from __future__ import annotations

import logging
from pathlib import Path
import threading
import uuid
import warnings
from datetime import timezone

import pytest
import redis
from sqlalchemy import func, select

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from broker.service.api import create_app
from broker.service.auth_cache import TokenCache
from broker.service.store.tables import Job, JobEvent
from broker.service.limits import QuotaExceeded, RateLimiter, RateLimitExceeded
from broker.model import JobSpec
from broker.service.settings import BrokerSettings, QuotaSettings, SettingsError, TeamLimits, load_settings
from broker.service.store.core import IdempotencyConflict, hash_token
from broker.service.tokens import create_token
from tests.conftest import REDIS_URL, auth

UTC = timezone.utc
SPEC = {"command": ["/bin/true"], "gpus_per_node": 1, "estimated_duration_s": 60}


@pytest.fixture(scope="module")
def store(module_pg_store):
    return module_pg_store


def _team(store):
    team = "t" + uuid.uuid4().hex[:10]
    return team, auth(create_token(store, team, label="test").token)


def _limiter(quotas: QuotaSettings, url: str = REDIS_URL) -> RateLimiter:
    return RateLimiter(url, quotas, prefix=f"test:{uuid.uuid4().hex[:8]}:")


def _client(store, quotas: QuotaSettings, limiter: RateLimiter | None = None) -> TestClient:
    return TestClient(create_app(store, BrokerSettings.model_construct(quotas=quotas), rate_limiter=limiter))


def _count(store, team: str) -> int:
    with store.session() as s:
        return s.execute(select(func.count()).select_from(Job).where(Job.team == team)).scalar_one()


# ----------------------------------------------------------------------------- settings
def test_quota_settings_per_team_overrides_and_unlimited():
    q = QuotaSettings(max_queued_jobs=100, submits_per_s=5, burst=20,
                      per_team={"vision": {"submits_per_s": 0}, "nlp": {"max_queued_jobs": None, "burst": 50}})
    caps = {"max_schedules": 100, "log_bytes": 2 ** 30, "max_time_limit_s": 604800.0,  # defaults: schedule cap, log
            "max_queued_spec_bytes": 256 * 2 ** 20,  # budget, time-limit ceiling, spec-bytes budgets
            "stored_spec_bytes": 2 ** 30}
    assert q.for_team("other") == TeamLimits(max_queued_jobs=100, submits_per_s=5.0, burst=20, **caps)
    assert q.for_team("vision") == TeamLimits(max_queued_jobs=100, submits_per_s=None, burst=None, **caps)
    assert q.for_team("nlp") == TeamLimits(max_queued_jobs=None, submits_per_s=5.0, burst=50, **caps)
    # a rate without a burst: the bucket holds one second of submits
    assert QuotaSettings(submits_per_s=2.5, burst=0).for_team("x").burst == 3
    assert BrokerSettings.model_construct().quotas.for_team("x") == TeamLimits(
        max_queued_jobs=10000, submits_per_s=50.0, burst=200, **caps)


def test_quota_settings_errors_name_the_key(tmp_path):
    cfg = tmp_path / "f.yaml"
    cfg.write_text("quotas:\n  per_team:\n    vision:\n      max_queued: 3\n")
    with pytest.raises(SettingsError, match=r"quotas\.per_team\.vision\.max_queued"):
        load_settings(cfg)
    cfg.write_text("quotas:\n  submits_per_s: -1\n")
    with pytest.raises(SettingsError, match=r"quotas\.submits_per_s=-1"):
        load_settings(cfg)


# ----------------------------------------------------------------------------- rate limit
def test_fourth_submit_over_burst_3_is_429_retry_after_1(store):
    quotas = QuotaSettings(submits_per_s=1, burst=3, max_queued_jobs=0)
    team, h = _team(store)
    with _client(store, quotas, _limiter(quotas)) as c:
        codes = [c.post("/v1/jobs", json={"spec": SPEC, "idempotency_key": f"k{i}"}, headers=h).status_code
                 for i in range(3)]
        assert codes == [201, 201, 201]
        r = c.post("/v1/jobs", json={"spec": SPEC, "idempotency_key": "k3"}, headers=h)
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "1"
        assert r.json() == {"detail": f"quotas.submits_per_s: team {team!r} may submit 1 jobs/s (burst 3); "
                                      f"retry after 1 s", "limit": "quotas.submits_per_s", "retry_after_s": 1}
        # an idempotent replay of an existing job is never refused
        again = c.post("/v1/jobs", json={"spec": SPEC, "idempotency_key": "k0"}, headers=h)
        assert again.status_code == 200
        # a schedule costs one submit too
        s = c.post("/v1/schedules", json={"name": "n", "cron": "@daily", "spec": SPEC}, headers=h)
        assert s.status_code == 429 and s.json()["limit"] == "quotas.submits_per_s"
    assert _count(store, team) == 3


def test_schedule_pause_and_resume_cost_a_submit_each(store):
    """Hostile pass of 2026-12-04 (B8): toggling one schedule wrote 177 audit rows/s, past the submit rate. With
    a burst of 3: the create and two toggles pass, the third toggle is 429 and writes no audit row."""
    from broker.service.store.tables import AuditEvent

    quotas = QuotaSettings(submits_per_s=0.01, burst=3, max_queued_jobs=0)
    team, h = _team(store)
    with _client(store, quotas, _limiter(quotas)) as c:
        sid = c.post("/v1/schedules", json={"name": "n", "cron": "@daily", "spec": SPEC}, headers=h).json()["id"]
        assert c.post(f"/v1/schedules/{sid}/pause", headers=h).status_code == 200
        assert c.post(f"/v1/schedules/{sid}/resume", headers=h).status_code == 200
        r = c.post(f"/v1/schedules/{sid}/pause", headers=h)
        assert r.status_code == 429 and r.json()["limit"] == "quotas.submits_per_s", r.text
        assert c.get(f"/v1/schedules/{sid}", headers=h).json()["enabled"] is True  # nothing changed
    with store.session() as s:
        rows = s.execute(select(AuditEvent.action).where(AuditEvent.target == sid).order_by(AuditEvent.id)).scalars()
        assert [a for a in rows if a.startswith("schedule.")] == ["schedule.create", "schedule.pause", "schedule.resume"]


def test_rate_limit_retry_after_rounds_up_and_per_team_override(store):
    quotas = QuotaSettings(submits_per_s=0.25, burst=1, max_queued_jobs=0,
                           per_team={"unlimited-team": {"submits_per_s": 0}})
    team, h = _team(store)
    free = auth(create_token(store, "unlimited-team", label="test").token)
    with _client(store, quotas, _limiter(quotas)) as c:
        assert c.post("/v1/jobs", json={"spec": SPEC}, headers=h).status_code == 201
        r = c.post("/v1/jobs", json={"spec": SPEC}, headers=h)
        assert (r.status_code, r.headers["Retry-After"]) == (429, "4")  # 1 token at 0.25/s
        assert [c.post("/v1/jobs", json={"spec": SPEC}, headers=free).status_code for _ in range(5)] == [201] * 5


def test_token_bucket_refills_and_batches_leave_debt():
    quotas = QuotaSettings(submits_per_s=1000, burst=10)
    lim = _limiter(quotas)
    lim.charge("a", 10)
    with pytest.raises(RateLimitExceeded) as e:
        lim.charge("a", 5)
    assert e.value.retry_after_s == 1 and e.value.limit == "quotas.submits_per_s"
    import time

    time.sleep(0.02)  # 1000/s: the bucket is full again after 10 ms
    lim.charge("a", 25)  # bigger than the bucket: let in when it is full, then in debt
    with pytest.raises(RateLimitExceeded):
        lim.charge("a", 1)
    lim.charge("b", 10)  # another team has its own bucket


def test_redis_down_fails_open_with_one_warning(store, caplog):
    quotas = QuotaSettings(submits_per_s=1, burst=1, max_queued_jobs=0)
    with socket_closed_port() as port:
        lim = _limiter(quotas, f"redis://127.0.0.1:{port}/0")
        team, h = _team(store)
        with caplog.at_level(logging.WARNING, logger="broker.service.limits"), _client(store, quotas, lim) as c:
            codes = [c.post("/v1/jobs", json={"spec": SPEC}, headers=h).status_code for _ in range(3)]
    assert codes == [201, 201, 201]
    warnings_ = [r for r in caplog.records if r.name == "broker.service.limits"]
    assert len(warnings_) == 1 and "Redis unreachable" in warnings_[0].getMessage()


class socket_closed_port:
    """A TCP port nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc) -> None:
        pass


# ----------------------------------------------------------------------------- queued-jobs quota
def test_queued_jobs_quota_429_then_room_after_cancel(store):
    quotas = QuotaSettings(max_queued_jobs=2, submits_per_s=0, quota_retry_after_s=30)
    team, h = _team(store)
    with _client(store, quotas) as c:
        a = c.post("/v1/jobs", json={"spec": SPEC, "idempotency_key": "a"}, headers=h).json()
        assert c.post("/v1/jobs", json={"spec": SPEC}, headers=h).status_code == 201
        r = c.post("/v1/jobs", json={"spec": SPEC}, headers=h)
        assert (r.status_code, r.headers["Retry-After"]) == (429, "30")
        assert r.json()["limit"] == "quotas.max_queued_jobs"
        assert r.json()["detail"].startswith(f"quotas.max_queued_jobs: team {team!r} may hold 2 unfinished jobs "
                                             f"and holds 2; this submit would exceed it")
        # a replay of an existing job is answered even at the quota
        assert c.post("/v1/jobs", json={"spec": SPEC, "idempotency_key": "a"}, headers=h).json()["id"] == a["id"]
        assert c.post(f"/v1/jobs/{a['id']}/cancel", headers=h).json()["state"] == "cancelled"
        assert c.post("/v1/jobs", json={"spec": SPEC}, headers=h).status_code == 201
    assert _count(store, team) == 3


@pytest.mark.parametrize("batch", [False, True])
def test_parallel_submits_never_exceed_the_quota_on_postgresql(store, batch):
    """20 threads submit at once (single jobs, or batches of 3) against a quota of 7: never more than 7 stored."""
    team = "t" + uuid.uuid4().hex[:10]
    spec = JobSpec.model_validate(SPEC)
    barrier = threading.Barrier(20)
    outcomes: list[str] = []

    def one(i: int) -> None:
        barrier.wait()
        try:
            if batch:
                store.submit_many(team, [(spec, f"{i}-{j}", None) for j in range(3)], max_unfinished=7)
            else:
                store.submit(team, spec, idempotency_key=str(i), max_unfinished=7)
            outcomes.append("ok")
        except QuotaExceeded:
            outcomes.append("429")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = _count(store, team)
    if batch:
        assert (stored, outcomes.count("ok"), outcomes.count("429")) == (6, 2, 18)
    else:
        assert (stored, outcomes.count("ok"), outcomes.count("429")) == (7, 7, 13)


def test_quota_and_bulk_submit_on_sqlite(sqlite_store):
    spec = JobSpec.model_validate(SPEC)
    sqlite_store.submit("a", spec, max_unfinished=1)
    with pytest.raises(QuotaExceeded) as e:
        sqlite_store.submit("a", spec, max_unfinished=1)
    assert e.value.retry_after_s == 30
    sqlite_store.submit("b", spec, max_unfinished=1)  # per team
    out = sqlite_store.submit_many("c", [(spec, "k1", None), (spec, "k2", None), (spec, "k1", None)], max_unfinished=2)
    assert [created for _, created in out] == [True, True, False] and out[2][0].id == out[0][0].id
    with pytest.raises(QuotaExceeded):
        sqlite_store.submit_many("c", [(spec, None, None)], max_unfinished=2)
    assert [e.to_state for e in sqlite_store.events(out[1][0].id)] == ["submitted"]


# ----------------------------------------------------------------------------- batch
def test_batch_partial_failure_gives_each_item_its_status(store):
    team, h = _team(store)
    items = [
        {"spec": SPEC, "idempotency_key": "a"},                                    # 201
        {"spec": {**SPEC, "gpus_per_node": -1}},                                    # 422 naming the field
        {"spec": {**SPEC, "team": "someone-else"}},                                 # 403
        {"spec": {**SPEC, "name": "b"}, "idempotency_key": "b"},                   # 201
        {"spec": {**SPEC, "name": "other"}, "idempotency_key": "a"},               # 409: key a, another spec
        {"spec": SPEC, "idempotency_key": "a"},                                     # 200: same as item 0
        {"spec": {**SPEC, "deadline": "2020-01-01T00:00:00Z"}},                     # 422 deadline passed
        {"spec": SPEC, "bogus": 1},                                                 # 422 unknown field
    ]
    with _client(store, QuotaSettings(submits_per_s=0)) as c:
        r = c.post("/v1/jobs:batch", json={"items": items}, headers=h)
    assert r.status_code == 200
    body = r.json()
    assert [x["status"] for x in body["results"]] == [201, 422, 403, 201, 409, 200, 422, 422]
    assert [x["index"] for x in body["results"]] == list(range(8))
    assert (body["created"], body["existing"], body["failed"]) == (2, 1, 5)
    res = body["results"]
    assert res[5]["job"]["id"] == res[0]["job"]["id"]
    assert res[1]["detail"][0]["loc"] == ["body", "items", 1, "spec", "gpus_per_node"]
    assert res[1]["detail"][0]["msg"].startswith("items.1.spec.gpus_per_node=-1: ")
    assert res[2]["detail"] == f"spec.team='someone-else': your token belongs to team {team!r}"
    assert res[4]["detail"].startswith("idempotency_key='a': already used by job ")
    assert res[6]["detail"][0]["msg"].startswith("items.6.spec.deadline='2020-01-01T00:00:00+00:00': must be after now")
    assert res[7]["detail"][0]["loc"] == ["body", "items", 7, "bogus"]
    assert _count(store, team) == 2
    with store.session() as s:  # each new job has its submitted event
        n_events = s.execute(select(func.count()).select_from(JobEvent).join(Job, Job.id == JobEvent.job_id)
                             .where(Job.team == team, JobEvent.to_state == "submitted")).scalar_one()
    assert n_events == 2


def test_batch_replay_is_idempotent_and_not_limited(store):
    team, h = _team(store)
    items = [{"spec": {**SPEC, "name": f"j{i}"}, "idempotency_key": f"k{i}"} for i in range(5)]
    quotas = QuotaSettings(submits_per_s=0.001, burst=5, max_queued_jobs=5)
    with _client(store, quotas, _limiter(quotas)) as c:
        first = c.post("/v1/jobs:batch", json={"items": items}, headers=h).json()
        assert [x["status"] for x in first["results"]] == [201] * 5
        again = c.post("/v1/jobs:batch", json={"items": items}, headers=h)
        assert again.status_code == 200  # bucket empty and quota full, but every item exists
        assert [x["status"] for x in again.json()["results"]] == [200] * 5
        assert [x["job"]["id"] for x in again.json()["results"]] == [x["job"]["id"] for x in first["results"]]
        more = c.post("/v1/jobs:batch", json={"items": items + [{"spec": SPEC}]}, headers=h)
        assert more.status_code == 429 and more.json()["limit"] == "quotas.submits_per_s"
    assert _count(store, team) == 5


def test_a_batch_of_replays_and_new_jobs_is_charged_its_new_jobs_only(store):
    """README: "a batch costs one per new job". Found by a hostile review: 5 replays and 1 new job with 1 token left
    were refused whole (429 "a request of 6 jobs"), the replays unanswered."""
    team, h = _team(store)
    items = [{"spec": {**SPEC, "name": f"j{i}"}, "idempotency_key": f"k{i}"} for i in range(5)]
    quotas = QuotaSettings(submits_per_s=0.001, burst=6, max_queued_jobs=10)
    with _client(store, quotas, _limiter(quotas)) as c:
        assert c.post("/v1/jobs:batch", json={"items": items}, headers=h).json()["created"] == 5  # 1 token left
        r = c.post("/v1/jobs:batch", json={"items": items + [{"spec": SPEC, "idempotency_key": "new"}]}, headers=h)
        assert r.status_code == 200, r.text
        assert [x["status"] for x in r.json()["results"]] == [200] * 5 + [201]
        # the bucket is empty now: the next new job is refused, and a replay of it is not
        r = c.post("/v1/jobs:batch", json={"items": [{"spec": SPEC, "idempotency_key": "newer"}]}, headers=h)
        assert r.status_code == 429 and r.json()["limit"] == "quotas.submits_per_s"
        r = c.post("/v1/jobs", json={"spec": SPEC}, headers={**h, "Idempotency-Key": "new"})
        assert r.status_code == 200
    assert _count(store, team) == 6


def test_batch_over_quota_stores_nothing_and_charges_items(store):
    team, h = _team(store)
    quotas = QuotaSettings(submits_per_s=1, burst=10, max_queued_jobs=4)
    lim = _limiter(quotas)
    with _client(store, quotas, lim) as c:
        r = c.post("/v1/jobs:batch", json={"items": [{"spec": SPEC}] * 5}, headers=h)
        assert (r.status_code, r.headers["Retry-After"]) == (429, "30")
        assert r.json()["detail"].startswith(f"quotas.max_queued_jobs: team {team!r} may hold 4 unfinished jobs and "
                                             f"holds 0; these 5 jobs would exceed it")
        assert _count(store, team) == 0
        # the refused batch took 5 tokens: 5 left, so a batch of 4 passes and then 2 more are refused
        assert c.post("/v1/jobs:batch", json={"items": [{"spec": SPEC}] * 4}, headers=h).json()["created"] == 4
        r = c.post("/v1/jobs:batch", json={"items": [{"spec": SPEC}] * 2}, headers=h)
        assert (r.status_code, r.json()["limit"], r.headers["Retry-After"]) == (429, "quotas.submits_per_s", "1")


def test_batch_bounds(store):
    team, h = _team(store)
    with _client(store, QuotaSettings(submits_per_s=0, max_queued_jobs=0)) as c:
        assert c.post("/v1/jobs:batch", json={"items": []}, headers=h).status_code == 422
        r = c.post("/v1/jobs:batch", json={"items": [{"spec": SPEC}] * 1001}, headers=h)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "items"]
        r = c.post("/v1/jobs:batch", json={"items": [{"spec": SPEC}] * 1000}, headers=h)
        assert r.json()["created"] == 1000
        assert c.post("/v1/jobs:batch", json={"items": [{"spec": SPEC}]}).status_code == 401
    assert _count(store, team) == 1000


def test_store_submit_many_conflict_in_batch(store):
    spec = JobSpec.model_validate(SPEC)
    other = spec.model_copy(update={"name": "x"})
    out = store.submit_many("tm" + uuid.uuid4().hex[:8], [(spec, "k", None), (other, "k", None), (spec, None, None)])
    assert out[0][1] is True and isinstance(out[1], IdempotencyConflict) and out[2][1] is True


# ----------------------------------------------------------------------------- token cache
def test_token_cache_ttl_lru_and_revocation(store):
    now = [0.0]
    cache: TokenCache[str] = TokenCache(ttl_s=5, max_entries=2, clock=lambda: now[0])
    cache.put("a", "A")
    cache.put("b", "B")
    assert cache.get("a") == "A"
    cache.put("c", "C")  # evicts b, the least recently used
    assert (cache.get("b"), cache.get("a"), cache.get("c")) == (None, "A", "C")
    cache.discard("c")
    assert cache.get("c") is None
    now[0] = 5.0
    assert cache.get("a") is None and len(cache) == 0
    # through the API: a revoked token works until its cache entry expires
    team, h = _team(store)
    app = create_app(store, BrokerSettings.model_construct(api_token_cache_s=3600.0))
    with TestClient(app) as c:
        assert c.get("/v1/jobs", headers=h).status_code == 200
        with store.session() as s:
            from broker.service.store.tables import ApiToken

            s.execute(ApiToken.__table__.update().where(
                ApiToken.token_hash == hash_token(h["Authorization"][7:])).values(revoked=True))
        assert c.get("/v1/jobs", headers=h).status_code == 200  # cached
        app.state.token_cache.clear()
        assert c.get("/v1/jobs", headers=h).status_code == 401
    with TestClient(create_app(store, BrokerSettings.model_construct(api_token_cache_s=0))) as c:
        assert c.get("/v1/jobs", headers=h).status_code == 401


def test_redis_client_cleanup():
    """The test buckets expire by themselves (PEXPIRE): no ``test:*`` key in the test database lives for ever.
    PTTL -2 is a key that expired between SCAN and PTTL (the buckets' TTLs are short), which is the point; -1 is a
    key without a TTL, which is the defect this looks for."""
    r = redis.Redis.from_url(REDIS_URL)
    lasting = [k for k in r.scan_iter("test:*") if r.pttl(k) == -1]
    assert lasting == []


def test_team_usage_counter_follows_every_change(store):
    """PostgreSQL keeps each team's unfinished-job count in team_usage (triggers, migration 0007):
    it equals a count of the jobs after inserts, transitions, bulk updates and deletes."""
    from sqlalchemy import text

    from broker.states import TERMINAL_STATES

    mig = (Path(__file__).parents[3] / "broker/service/store/migrations/versions/0007_jobs_team_state_index.py").read_text()
    assert "_DONE = \"(" + ", ".join(repr(s.value) for s in sorted(TERMINAL_STATES, key=lambda s: ["succeeded", "failed", "cancelled"].index(s.value))) + ")\"" in mig
    team, other = "tu" + uuid.uuid4().hex[:8], "tv" + uuid.uuid4().hex[:8]
    spec = JobSpec.model_validate(SPEC)

    def usage() -> dict:
        with store.session() as s:
            rows = s.execute(text("SELECT team, unfinished FROM team_usage WHERE team IN (:a, :b)"),
                             {"a": team, "b": other}).all()
        return {t: n for t, n in rows}

    def counted() -> dict:
        with store.session() as s:
            rows = s.execute(select(Job.team, func.count()).where(Job.team.in_([team, other]),
                             Job.state.notin_([x.value for x in TERMINAL_STATES])).group_by(Job.team)).all()
        return {t: n for t, n in rows}

    jobs = [store.submit(team, spec)[0] for _ in range(3)]
    store.submit_many(other, [(spec, None, None)] * 4)
    assert usage() == counted() == {team: 3, other: 4}
    store.request_cancel(jobs[0].id)
    assert store.transition(jobs[1].id, "queued", "test")  # not a finish: no change
    assert usage() == counted() == {team: 2, other: 4}
    with store.session() as s:  # one statement over both teams
        s.execute(Job.__table__.update().where(Job.team.in_([team, other]), Job.state == "submitted")
                  .values(state="failed"))
    assert usage() == {team: 1, other: 0} and counted() == {team: 1}
    with store.session() as s:
        s.execute(Job.__table__.delete().where(Job.team == team))
    assert usage() == {team: 0, other: 0}


# ----------------------------------------------------------------------------- forged buckets (issue 20)
@pytest.mark.parametrize("tokens,at_ahead_s", [
    ("-1000000", 0.0),   # the attacker's HSET fedbroker:rate:victim tokens -1000000 (429 for 5.5 h on cb5ea98)
    ("-801", 0.0),        # below the lowest a real batch leaves: burst 200 - MAX_BATCH_ITEMS 1000
    ("201", 0.0),         # above the burst
    ("nan", 0.0), ("inf", 0.0), ("-inf", 0.0), ("lots", 0.0),
    ("0", 3600.0),        # an 'at' an hour ahead of Redis's clock: no refill for an hour
])
def test_a_forged_bucket_starts_full_again(tokens, at_ahead_s):
    lim = _limiter(QuotaSettings(submits_per_s=50, burst=200))
    key = lim.prefix + "victim"
    now = lim.redis.time()
    lim.redis.hset(key, mapping={"tokens": tokens, "at": repr(now[0] + now[1] / 1e6 + at_ahead_s)})
    lim.redis.expire(key, 20000)
    lim.charge("victim", 200)  # a full bucket's worth, at once: only a full bucket lets it in
    assert float(lim.redis.hget(key, "tokens")) == 0.0
    # the TTL is the script's again: 200 tokens at 50/s refill in 4 s (+ 1 s)
    assert 4000 < lim.redis.pttl(key) <= 5000
    with pytest.raises(RateLimitExceeded) as e:
        lim.charge("victim", 1)
    assert e.value.retry_after_s == 1


def test_a_real_batch_debt_is_kept():
    """The lowest a real charge leaves (a full bucket of 200 minus a 1,000-job batch) is not taken as forged."""
    lim = _limiter(QuotaSettings(submits_per_s=50, burst=200))
    lim.charge("a", 1000)
    assert float(lim.redis.hget(lim.prefix + "a", "tokens")) == pytest.approx(-800.0, abs=0.1)
    with pytest.raises(RateLimitExceeded) as e:
        lim.charge("a", 1)
    assert e.value.retry_after_s == 17  # (1 + 800) / 50 = 16.02 s, rounded up
