"""Token kinds, lifetimes, revoke/rotate, the bootstrap rule and the audit log (broker.service.tokens, broker.service.api_tokens).

API tests run on the module's PostgreSQL schema through FastAPI's TestClient; store-level rules run on
PostgreSQL and SQLite (``any_store``).
"""

from __future__ import annotations

import uuid
import warnings
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as hs
from sqlalchemy import select, update

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from broker.service.api import create_app
from broker.service.store.tables import ApiToken, AuditEvent
from broker.service.settings import BrokerSettings
from broker.service.store.core import hash_token
from broker.service import tokens as T
from tests.conftest import auth

UTC = timezone.utc
ADMIN = "admin-secret-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def store(module_pg_store):
    return module_pg_store


@pytest.fixture(scope="module")
def client(store):
    # no token cache: these tests revoke and expire tokens behind the API's back, in the database
    with TestClient(create_app(store, BrokerSettings(admin_token=ADMIN, api_token_cache_s=0))) as c:
        yield c


def fresh_team() -> str:
    return "t" + uuid.uuid4().hex[:10]


def mint(store, team: str, kind: str, **kw) -> tuple[str, str]:
    """(secret, public id) of a new token made directly in the store."""
    made = T.create_token(store, team, kind, **kw)
    return made.token, made.id


def job_body() -> dict:
    return {"spec": {"command": ["true"], "name": "x"}}


# ----------------------------------------------------------------------------- kinds over the API
def test_read_only_token_reads_but_cannot_write(client, store):
    team = fresh_team()
    member, _ = mint(store, team, "member")
    ro, _ = mint(store, team, "read-only")
    job = client.post("/v1/jobs", json=job_body(), headers=auth(member)).json()
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth(ro)).json()["id"] == job["id"]
    assert [j["id"] for j in client.get("/v1/jobs", headers=auth(ro)).json()] == [job["id"]]
    r = client.post("/v1/jobs", json=job_body(), headers=auth(ro))
    assert r.status_code == 403 and r.json()["detail"] == "POST /v1/jobs: a read-only token may only read (GET)"
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth(ro))
    assert r.status_code == 403
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth(member)).json()["state"] == "submitted"
    r = client.post("/v1/schedules", json={"name": "n", "cron": "@daily", "spec": {"command": ["true"]}},
                    headers=auth(ro))
    assert r.status_code == 403
    # its own team only, like a member
    other, _ = mint(store, fresh_team(), "member")
    theirs = client.post("/v1/jobs", json=job_body(), headers=auth(other)).json()
    assert client.get(f"/v1/jobs/{theirs['id']}", headers=auth(ro)).status_code == 404


def test_node_token_may_not_use_job_or_schedule_routes(client, store):
    tok, tid = mint(store, "ops", "node", node="gpu-01")
    p = T.principal_of(store, tok)
    assert (p.kind, p.team, p.node, p.token_id, p.admin) == ("node", T.NODE_TEAM, "gpu-01", tid, False)  # no team
    for method, path in [("get", "/v1/jobs"), ("post", "/v1/jobs"), ("get", "/v1/jobs/job-0123456789abcdef"),
                         ("get", "/v1/schedules"), ("get", "/v1/tokens"), ("get", "/v1/audit")]:
        kw = {"json": job_body()} if method == "post" else {}
        r = getattr(client, method)(path, headers=auth(tok), **kw)
        assert r.status_code == 403, (path, r.text)


def test_member_cannot_manage_tokens(client, store):
    team = fresh_team()
    member, _ = mint(store, team, "member")
    _, other_id = mint(store, team, "member")
    r = client.get("/v1/tokens", headers=auth(member))
    assert r.status_code == 403
    assert r.json()["detail"] == "a member token cannot manage tokens (needs a team-admin or admin token)"
    assert client.post("/v1/tokens", json={"kind": "member"}, headers=auth(member)).status_code == 403
    assert client.post(f"/v1/tokens/{other_id}/revoke", headers=auth(member)).status_code == 403
    assert client.post(f"/v1/tokens/{other_id}/rotate", headers=auth(member)).status_code == 403


def test_team_admin_manages_own_team_only(client, store):
    team, other = fresh_team(), fresh_team()
    ta, ta_id = mint(store, team, "team-admin")
    _, m_id = mint(store, team, "member")
    _, other_id = mint(store, other, "member")
    # creates member and read-only tokens of its own team (team defaults to the caller's)
    r = client.post("/v1/tokens", json={"kind": "read-only", "label": "finance", "ttl_s": 7 * 86400}, headers=auth(ta))
    assert r.status_code == 201, r.text
    made = r.json()
    assert (made["team"], made["kind"], made["label"]) == (team, "read-only", "finance")
    assert T.TOKEN_ID_RE.match(made["id"]) and made["token"].startswith("fbk_")
    created = datetime.fromisoformat(made["created_at"])
    assert datetime.fromisoformat(made["expires_at"]) - created == timedelta(days=7)
    # never admin, team-admin or node tokens, nor another team's
    for body in ({"kind": "admin"}, {"kind": "team-admin"}, {"kind": "node", "node": "n1"},
                 {"kind": "member", "team": other}):
        r = client.post("/v1/tokens", json=body, headers=auth(ta))
        assert r.status_code == 403, (body, r.text)
    r = client.post("/v1/tokens", json={"kind": "admin"}, headers=auth(ta))
    assert r.json()["detail"] == ("kind='admin': a team admin may create only member, read-only tokens; "
                                  "ask a broker admin")
    # lists its own team's tokens (no secrets); another team's list is 403, another team's token 404
    listed = client.get("/v1/tokens", headers=auth(ta)).json()
    assert {t["id"] for t in listed} == {ta_id, m_id, made["id"]}
    assert all("token" not in t and t["team"] == team for t in listed)
    assert client.get("/v1/tokens", params={"team": other}, headers=auth(ta)).status_code == 403
    r = client.post(f"/v1/tokens/{other_id}/revoke", headers=auth(ta))
    assert r.status_code == 404 and r.json()["detail"] == f"token_id={other_id!r}: no such token for team {team!r}"
    assert client.post(f"/v1/tokens/{m_id}/revoke", headers=auth(ta)).json()["revoked"] is True


def test_a_team_admin_never_makes_a_token_that_outlives_its_own(client, store):
    team = fresh_team()
    ta, _ = mint(store, team, "team-admin", ttl=2 * 86400)  # expires in 2 days
    r = client.post("/v1/tokens", json={"kind": "member", "ttl_s": 10 * 365 * 86400}, headers=auth(ta))
    assert r.status_code == 201, r.text
    ta_expiry = T.principal_of(store, ta).expires_at
    assert datetime.fromisoformat(r.json()["expires_at"]) == ta_expiry  # cut to the team admin's own expiry
    r = client.post(f"/v1/tokens/{r.json()['id']}/rotate", json={"ttl_s": 10 * 365 * 86400}, headers=auth(ta))
    assert r.status_code == 201 and datetime.fromisoformat(r.json()["expires_at"]) == ta_expiry
    # a shorter lifetime is kept; a broker admin's tokens are not cut
    r = client.post("/v1/tokens", json={"kind": "member", "ttl_s": 3600}, headers=auth(ta))
    made = r.json()
    assert datetime.fromisoformat(made["expires_at"]) - datetime.fromisoformat(made["created_at"]) == timedelta(hours=1)
    r = client.post("/v1/tokens", json={"team": team, "kind": "member", "ttl_s": 10 * 365 * 86400}, headers=auth(ADMIN))
    made = r.json()
    assert (datetime.fromisoformat(made["expires_at"]) - datetime.fromisoformat(made["created_at"])
            == timedelta(days=3650))


def test_admin_creates_any_kind_and_validation_names_the_field(client, store):
    team = fresh_team()
    r = client.post("/v1/tokens", json={"team": team, "kind": "node", "node": "gpu-7"}, headers=auth(ADMIN))
    assert r.status_code == 201 and (r.json()["kind"], r.json()["node"]) == ("node", "gpu-7")
    r = client.post("/v1/tokens", json={"team": team, "kind": "node"}, headers=auth(ADMIN))
    assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("node=None: a node token needs")
    r = client.post("/v1/tokens", json={"team": team, "kind": "member", "node": "gpu-7"}, headers=auth(ADMIN))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "node"]
    r = client.post("/v1/tokens", json={"team": team, "ttl_s": 10}, headers=auth(ADMIN))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "ttl_s"]
    r = client.post("/v1/tokens", json={"team": team, "kind": "root"}, headers=auth(ADMIN))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "kind"]
    r = client.post("/v1/tokens", json={"team": team, "label": "ci\x1b[2J"}, headers=auth(ADMIN))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "label"]  # shown by tokens list
    with pytest.raises(T.InvalidTokenRequest) as e:
        T.create_token(store, team, label="ci\x07")
    assert str(e.value) == "label='ci\\x07': contains the control character '\\x07'"
    # a format character (issue #20 B7): the rule of a job's name (broker.model.line_problem)
    for label, cp in (("ci\u202eexe.png", "U+202E"), ("ci\U000e0041", "U+E0041")):
        r = client.post("/v1/tokens", json={"team": team, "label": label}, headers=auth(ADMIN))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "label"]
        assert r.json()["detail"][0]["msg"] == f"label={label!r}: contains the format character {cp}"
    with pytest.raises(T.InvalidTokenRequest) as e:
        T.create_token(store, team, label="ci\u2066x")
    assert str(e.value) == "label='ci\\u2066x': contains the format character U+2066"
    assert T.create_token(store, team, label="Übung-日本 CI").label == "Übung-日本 CI"
    # an instant UTC cannot hold (year 1 with an offset): 422 naming it, once a 500
    r = client.get("/v1/audit", params={"since": "0001-01-01T00:00:00+01:00"}, headers=auth(ADMIN))
    assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("since='0001-01-01T00:00:00+01:00'")
    # the default lifetime is the setting (90 days)
    made = client.post("/v1/tokens", json={"team": team, "kind": "admin"}, headers=auth(ADMIN)).json()
    life = datetime.fromisoformat(made["expires_at"]) - datetime.fromisoformat(made["created_at"])
    assert life == timedelta(days=90)
    assert client.get("/v1/jobs", headers=auth(made["token"])).status_code == 200


# ----------------------------------------------------------------------------- expiry, revoke, rotate
def test_expired_token_is_401_token_expired(client, store):
    tok, tid = mint(store, fresh_team(), "member")
    assert client.get("/v1/jobs", headers=auth(tok)).status_code == 200
    with store.session() as s:
        s.execute(update(ApiToken).where(ApiToken.public_id == tid)
                  .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    r = client.get("/v1/jobs", headers=auth(tok))
    assert r.status_code == 401 and r.json()["detail"] == "token expired"
    r = client.get("/v1/jobs", headers=auth("fbk_unknown"))
    assert r.status_code == 401 and r.json()["detail"] == "unknown or revoked token"
    assert T.principal_of(store, tok) is None


def test_revoke_and_rotate_over_the_api(client, store):
    team = fresh_team()
    old, old_id = mint(store, team, "member", label="ci")
    assert client.get("/v1/jobs", headers=auth(old)).status_code == 200
    r = client.post(f"/v1/tokens/{old_id}/rotate", json={"ttl_s": 3600}, headers=auth(ADMIN))
    assert r.status_code == 201, r.text
    new = r.json()
    assert new["id"] != old_id and new["rotated_from"] == old_id
    assert (new["team"], new["kind"], new["label"]) == (team, "member", "ci")
    assert datetime.fromisoformat(new["expires_at"]) - datetime.fromisoformat(new["created_at"]) == timedelta(hours=1)
    assert client.get("/v1/jobs", headers=auth(old)).status_code == 401  # right after
    assert client.get("/v1/jobs", headers=auth(new["token"])).status_code == 200
    r = client.post(f"/v1/tokens/{old_id}/rotate", headers=auth(ADMIN))
    assert r.status_code == 409
    r = client.post(f"/v1/tokens/{new['id']}/revoke", headers=auth(ADMIN))
    assert r.status_code == 200 and r.json()["revoked"] is True
    assert client.get("/v1/jobs", headers=auth(new["token"])).status_code == 401
    assert client.post("/v1/tokens/tok-nope/revoke", headers=auth(ADMIN)).status_code == 404
    listed = client.get("/v1/tokens", params={"team": team, "include_revoked": True}, headers=auth(ADMIN)).json()
    assert [(t["id"], t["revoked"]) for t in listed] == [(old_id, True), (new["id"], True)]
    assert client.get("/v1/tokens", params={"team": team}, headers=auth(ADMIN)).json() == []


# ----------------------------------------------------------------------------- audit
def test_audit_rows_for_submit_cancel_revoke(client, store):
    team = fresh_team()
    ta, ta_id = mint(store, team, "team-admin")
    member, member_id = mint(store, team, "member")
    since = datetime.now(UTC)
    job = client.post("/v1/jobs", json=job_body(), headers=auth(member)).json()
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth(member)).json()["state"] == "cancelled"
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth(member))  # a no-op: no second event
    assert client.post(f"/v1/tokens/{member_id}/revoke", headers=auth(ta)).status_code == 200
    client.post(f"/v1/tokens/{member_id}/revoke", headers=auth(ta))  # a no-op: no second event
    rows = client.get("/v1/audit", params={"since": since.isoformat()}, headers=auth(ADMIN)).json()
    mine = [(e["action"], e["target"], e["actor_token_id"], e["actor_team"], e["actor_kind"])
            for e in reversed(rows) if e["actor_team"] == team]
    assert mine == [("job.submit", job["id"], member_id, team, "member"),
                    ("job.cancel", job["id"], member_id, team, "member"),
                    ("token.revoke", member_id, ta_id, team, "team-admin")]
    cancel = next(e for e in rows if e["action"] == "job.cancel" and e["target"] == job["id"])
    assert cancel["detail"] == {"team": team, "from_state": "submitted", "to_state": "cancelled"}
    # admin only; limit and action filters
    assert client.get("/v1/audit", headers=auth(ta)).status_code == 403
    one = client.get("/v1/audit", params={"action": "token.revoke", "limit": 1}, headers=auth(ADMIN)).json()
    assert len(one) == 1 and one[0]["target"] == member_id
    r = client.get("/v1/audit", params={"since": "2026-01-01T00:00:00"}, headers=auth(ADMIN))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "since"]


def test_schedule_changes_are_audited_with_the_settings_admin(client, store):
    since = datetime.now(UTC)
    team = fresh_team()
    r = client.post("/v1/schedules", json={"name": "nightly", "cron": "0 2 * * *",
                                           "spec": {"command": ["true"], "team": team}}, headers=auth(ADMIN))
    sid = r.json()["id"]
    client.post(f"/v1/schedules/{sid}/pause", headers=auth(ADMIN))
    client.post(f"/v1/schedules/{sid}/pause", headers=auth(ADMIN))  # no change, no event
    client.post(f"/v1/schedules/{sid}/resume", headers=auth(ADMIN))
    assert client.delete(f"/v1/schedules/{sid}", headers=auth(ADMIN)).status_code == 204
    rows = [e for e in client.get("/v1/audit", params={"since": since.isoformat()}, headers=auth(ADMIN)).json()
            if e["target"] == sid]
    assert [(e["action"], e["actor_token_id"], e["actor_kind"], e["detail"]["team"]) for e in reversed(rows)] == [
        ("schedule.create", "settings-admin", "admin", team), ("schedule.pause", "settings-admin", "admin", team),
        ("schedule.resume", "settings-admin", "admin", team), ("schedule.delete", "settings-admin", "admin", team)]


def test_token_operation_and_its_audit_row_share_a_transaction(any_store, monkeypatch):
    """When the audit row cannot be written, the token operation is not stored either (and the reverse)."""
    made = T.create_token(any_store, "solo", "member")

    def broken(*a, **kw):
        raise RuntimeError("audit table unavailable")

    monkeypatch.setattr(T, "audit", broken)
    with pytest.raises(RuntimeError):
        T.create_token(any_store, "solo", "read-only")
    with pytest.raises(RuntimeError):
        T.revoke(any_store, made.id)
    with pytest.raises(RuntimeError):
        T.rotate(any_store, made.id)
    monkeypatch.undo()
    assert [(t.id, t.kind, t.revoked) for t in T.list_tokens(any_store, team="solo", include_revoked=True)] == [
        (made.id, "member", False)]
    assert [(e.action, e.target) for e in T.audit_events(any_store)] == [("token.create", made.id)]


# ----------------------------------------------------------------------------- store-level rules (PG and SQLite)
def test_bootstrap_only_on_a_fresh_store(any_store):
    first = T.bootstrap(any_store, "vision")  # the README's first token: member, no admin yet
    assert (first.kind, first.team) == ("member", "vision")
    admin = T.bootstrap(any_store, "ops", "admin", label="root")
    assert T.principal_of(any_store, admin.token).admin
    with pytest.raises(T.BootstrapRefused, match="already has an admin token"):
        T.bootstrap(any_store, "ops", "admin")
    with pytest.raises(T.BootstrapRefused):
        T.bootstrap(any_store, "vision")
    # a revoked (or expired) admin token opens it again
    T.revoke(any_store, admin.id)
    again = T.bootstrap(any_store, "ops", "admin")
    with any_store.session() as s:
        s.execute(update(ApiToken).where(ApiToken.public_id == again.id)
                  .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    T.bootstrap(any_store, "ops", "admin")
    events = T.audit_events(any_store, action="token.bootstrap")
    assert [(e.target, e.actor_kind, e.actor_token_id, e.detail["kind"]) for e in reversed(events)][:3] == [
        (first.id, "database", None, "member"), (admin.id, "database", None, "admin"),
        (again.id, "database", None, "admin")]


def test_last_used_is_written_at_most_once_a_minute(any_store):
    tok, tid = mint(any_store, "solo", "member")
    t0 = datetime.now(UTC) + timedelta(hours=1)

    def last_used():
        with any_store.session() as s:
            return s.execute(select(ApiToken.last_used_at).where(ApiToken.public_id == tid)).scalar_one()

    assert last_used() is None
    for dt in (0, 1, 30, 59):
        assert T.authenticate(any_store, tok, now=t0 + timedelta(seconds=dt)).token_id == tid
        assert last_used() == t0
    T.authenticate(any_store, tok, now=t0 + timedelta(seconds=60))
    assert last_used() == t0 + timedelta(seconds=60)
    T.authenticate(any_store, tok, now=t0 + timedelta(seconds=119))
    assert last_used() == t0 + timedelta(seconds=60)


def test_expiry_and_kinds_at_the_store(any_store):
    t0 = datetime.now(UTC)
    made = T.create_token(any_store, "solo", "read-only", ttl="12h", now=t0)
    assert made.expires_at == t0 + timedelta(hours=12)
    assert T.authenticate(any_store, made.token, now=t0 + timedelta(hours=11, minutes=59)).kind == "read-only"
    with pytest.raises(T.TokenExpired, match="token expired at"):
        T.authenticate(any_store, made.token, now=t0 + timedelta(hours=12))
    with pytest.raises(T.InvalidToken):
        T.authenticate(any_store, "fbk_nothing")
    # the old signature still works: admin flag, label, default lifetime 90 days
    legacy = T.create_token(any_store, "solo", "admin", label="x").token
    p = T.principal_of(any_store, legacy)
    assert (p.kind, p.admin, p.team) == ("admin", True, "solo")
    with any_store.session() as s:
        r = s.execute(select(ApiToken).where(ApiToken.token_hash == hash_token(legacy))).scalar_one()
        assert (r.admin, r.kind, r.label) == (True, "admin", "x")
        assert timedelta(days=90) - timedelta(seconds=5) < r.expires_at - r.created_at <= timedelta(days=90)
    tok = T.create_token(any_store, "solo", "team-admin", ttl=3600).token
    assert T.principal_of(any_store, tok).kind == "team-admin"


@pytest.mark.parametrize("text, seconds", [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("45s", None),
                                           ("3600", 3600), ("2w", 14 * 86400), (" 1.5h ", 5400), (7200, 7200),
                                           (timedelta(days=1), 86400), ("3650d", 3650 * 86400)])
def test_parse_ttl(text, seconds):
    if seconds is None:
        with pytest.raises(T.InvalidTokenRequest, match=r"ttl='45s': must be between 60 s and 3650 days"):
            T.parse_ttl(text)
    else:
        assert T.parse_ttl(text) == seconds


@given(n=hs.integers(min_value=0, max_value=10**7), unit=hs.sampled_from(["", "s", "m", "h", "d", "w"]))
def test_parse_ttl_units(n, unit):
    seconds = n * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[unit]
    if 60 <= seconds <= 3650 * 86400:
        assert T.parse_ttl(f"{n}{unit}") == seconds == T.parse_ttl(f"{n}{unit.upper()}")
    else:
        with pytest.raises(T.InvalidTokenRequest, match=r"must be between 60 s and 3650 days"):
            T.parse_ttl(f"{n}{unit}")


@pytest.mark.parametrize("bad", ["", "d", "10y", "-5d", "3651d", "1e9", True])
def test_parse_ttl_refuses(bad):
    with pytest.raises(T.InvalidTokenRequest) as e:
        T.parse_ttl(bad)
    assert e.value.field == "ttl" and str(e.value).startswith(f"ttl={bad!r}: ")


def test_principal_keeps_the_admin_flag():
    from broker.service.store.core import Principal

    assert Principal("a", admin=True).kind == "admin" and Principal("a", True).admin
    assert Principal("a").kind == "member" and not Principal("a").admin
    assert Principal("a", kind="node", node="n").node == "n"


# ----------------------------------------------------------------------------- migration 0004
@pytest.fixture(params=["postgresql", "sqlite"])
def bare_store(request, tmp_path):
    """A store with no tables yet (PostgreSQL: a fresh schema; SQLite: a new file)."""
    from broker.service.store.core import JobStore
    from tests.conftest import PG_URL

    if request.param == "postgresql":
        st = JobStore(PG_URL, schema=f"t_{uuid.uuid4().hex[:12]}")
    else:
        st = JobStore(f"sqlite:///{tmp_path / 'old.db'}")
    yield st
    st.drop_schema()


def test_migration_0004_maps_existing_tokens(bare_store):
    from sqlalchemy import text

    bare_store.migrate("0003")
    made = datetime.now(UTC)
    with bare_store.engine.begin() as c:
        for team, admin, secret in (("ops", True, "fbk_old-admin"), ("vision", False, "fbk_old-member")):
            c.execute(text("INSERT INTO api_tokens (team, token_hash, admin, label, created_at, revoked) "
                           "VALUES (:t, :h, :a, '', :c, :r)"),
                      {"t": team, "h": hash_token(secret), "a": admin, "c": made.replace(tzinfo=None)
                       if bare_store.url.startswith("sqlite") else made, "r": False})
    bare_store.migrate()
    a, m = T.principal_of(bare_store, "fbk_old-admin"), T.principal_of(bare_store, "fbk_old-member")
    assert (a.kind, a.team, a.admin) == ("admin", "ops", True)
    assert (m.kind, m.team, m.admin) == ("member", "vision", False)
    assert T.TOKEN_ID_RE.match(a.token_id) and T.TOKEN_ID_RE.match(m.token_id) and a.token_id != m.token_id
    views = {t.team: t for t in T.list_tokens(bare_store)}
    for v in views.values():  # every legacy token now expires 90 days after the migration
        assert timedelta(days=90) - timedelta(minutes=5) < v.expires_at - made <= timedelta(days=90, minutes=5)
        assert v.last_used_at is not None and v.node is None  # authenticate above stamped it
    assert T.audit_events(bare_store) == []
    # the bootstrap rule sees the legacy admin
    with pytest.raises(T.BootstrapRefused):
        T.bootstrap(bare_store, "x", "admin")


def test_admin_token_sha256_setting(store):
    secret = "break-glass-" + uuid.uuid4().hex
    with TestClient(create_app(store, BrokerSettings(admin_token_sha256=hash_token(secret)))) as c:
        assert c.get("/v1/audit", params={"limit": 1}, headers=auth(secret)).status_code == 200
        r = c.post("/v1/tokens", json={"team": "ops", "kind": "admin"}, headers=auth(secret))
        assert r.status_code == 201
        [ev] = c.get("/v1/audit", params={"limit": 1}, headers=auth(secret)).json()
        assert (ev["action"], ev["target"], ev["actor_token_id"], ev["actor_kind"]) == (
            "token.create", r.json()["id"], "settings-admin", "admin")
        assert c.get("/v1/jobs", headers=auth(hash_token(secret))).status_code == 401  # the digest is no token
    with pytest.raises(Exception, match="admin_token_sha256"):
        BrokerSettings(admin_token_sha256="not-hex")


def test_serve_all_replaces_its_agents_node_token(store):
    from broker.cli.serve import SERVE_ALL_LABEL

    node = "vm-" + uuid.uuid4().hex[:6]
    old = [T.create_node_token(store, node, label=SERVE_ALL_LABEL) for _ in range(2)]
    kept = [T.create_node_token(store, node, label="rack 4"), T.create_node_token(store, node + "x", label=SERVE_ALL_LABEL)]
    assert T.revoke_node_tokens(store, node, SERVE_ALL_LABEL) == 2
    assert [T.node_of_token(store, t) for t in old] == [None, None]
    assert [T.node_of_token(store, t) for t in kept] == [node, node + "x"]
    assert T.revoke_node_tokens(store, node, SERVE_ALL_LABEL) == 0


def test_a_new_sqlite_store_is_private_and_the_cli_says_it_made_one(tmp_path):
    import os
    import stat

    from typer.testing import CliRunner

    from broker.cli.main import app
    from broker.service.store.core import JobStore

    db = tmp_path / "state" / "fedbroker.db"
    cfg = tmp_path / "fb.yaml"
    cfg.write_text(f"database_url: sqlite:///{db}\n")
    r = CliRunner().invoke(app, ["tokens", "create", "--team", "vision", "--config", str(cfg)],
                           env={"FEDBROKER_TOKEN": ""})
    assert r.exit_code == 0, r.output
    assert f"note: no job store at sqlite:///{db} yet; created a new, empty one" in r.stderr
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (db.parent, db)] == [0o700, 0o600]
    assert JobStore(f"sqlite:///{db}").created_file is False  # it exists now
    r = CliRunner().invoke(app, ["tokens", "create", "--team", "ops", "--admin", "--config", str(cfg)],
                           env={"FEDBROKER_TOKEN": ""})
    assert r.exit_code == 0 and "note:" not in r.stderr


def test_a_team_admin_rotates_its_own_token_but_not_another_team_admins(client, store):
    team = fresh_team()
    ta, ta_id = mint(store, team, "team-admin")
    _, other_ta_id = mint(store, team, "team-admin")
    r = client.post(f"/v1/tokens/{other_ta_id}/rotate", headers=auth(ta))
    assert r.status_code == 403 and "may create only member, read-only tokens" in r.json()["detail"]
    assert T.list_tokens(store, team=team)[1].revoked is False  # the other team admin keeps its token
    r = client.post(f"/v1/tokens/{ta_id}/rotate", json={"ttl_s": 30 * 86400}, headers=auth(ta))
    assert r.status_code == 201 and r.json()["kind"] == "team-admin"
    made = r.json()  # 30 days is within the old token's 90: kept
    assert datetime.fromisoformat(made["expires_at"]) - datetime.fromisoformat(made["created_at"]) == timedelta(days=30)


def test_rotation_never_extends_a_team_admins_lifetime_issue_9(client, store):
    """Issue #9: a 1-hour team-admin token rotated itself to 90 days (no body) and to 2036 (ttl_s 10 years), then
    rotated a member token and minted members to 2036. Every expiry now stays <= the original 1-hour one."""
    team = fresh_team()
    made = client.post("/v1/tokens", json={"team": team, "kind": "team-admin", "ttl_s": 3600},
                       headers=auth(ADMIN)).json()
    ta, first_expiry = made["token"], datetime.fromisoformat(made["expires_at"])
    _, member_id = mint(store, team, "member", ttl=3 * 86400)
    r = client.post(f"/v1/tokens/{made['id']}/rotate", headers=auth(ta))  # no body: the 90-day default
    assert r.status_code == 201, r.text
    assert datetime.fromisoformat(r.json()["expires_at"]) == first_expiry  # capped to the old expiry
    ta = r.json()["token"]
    r = client.post(f"/v1/tokens/{r.json()['id']}/rotate", json={"ttl_s": 315360000}, headers=auth(ta))
    assert r.status_code == 201 and datetime.fromisoformat(r.json()["expires_at"]) == first_expiry
    ta = r.json()["token"]
    r = client.post(f"/v1/tokens/{member_id}/rotate", json={"ttl_s": 315360000}, headers=auth(ta))
    assert r.status_code == 201 and datetime.fromisoformat(r.json()["expires_at"]) == first_expiry
    r = client.post("/v1/tokens", json={"kind": "member", "ttl_s": 315360000}, headers=auth(ta))
    assert r.status_code == 201 and datetime.fromisoformat(r.json()["expires_at"]) == first_expiry
    live = T.list_tokens(store, team=team)  # the team admin, the rotated member, the minted member
    assert [t.expires_at for t in live] == [first_expiry] * 3
    # a broker admin still rotates with a longer lifetime (here the team admin's own token, to 10 years)
    own_id = [t.id for t in T.list_tokens(store, team=team) if t.kind == "team-admin"][0]
    r = client.post(f"/v1/tokens/{own_id}/rotate", json={"ttl_s": 315360000}, headers=auth(ADMIN))
    assert r.status_code == 201
    new = r.json()
    assert datetime.fromisoformat(new["expires_at"]) - datetime.fromisoformat(new["created_at"]) == timedelta(days=3650)


def test_a_team_admin_cannot_rotate_an_expired_member_token(client, store):
    team = fresh_team()
    ta, _ = mint(store, team, "team-admin")
    _, member_id = mint(store, team, "member", ttl=120)
    later = datetime.now(UTC) + timedelta(seconds=150)  # the member token expired 30 s ago
    with pytest.raises(T.InvalidTokenRequest, match=r"ttl=.*the token expires in 0 s and rotation does not extend"):
        T.rotate(store, member_id, actor=T.principal_of(store, ta), now=later)
    assert T.list_tokens(store, team=team)[-1].revoked is False  # refused before revoking
    assert T.rotate(store, member_id, now=later).rotated_from == member_id  # direct store access (the admin CLI) may


def test_a_team_admin_about_to_expire_cannot_make_tokens(client, store):
    team = fresh_team()
    ta, _ = mint(store, team, "team-admin", ttl=120)
    later = datetime.now(UTC) + timedelta(seconds=90)  # 30 s left: less than the 60 s a token must live
    with pytest.raises(T.InvalidTokenRequest, match=r"ttl=.*your own token expires in 30 s"):
        T.create_token(store, team, "member", actor=T.principal_of(store, ta), now=later)
