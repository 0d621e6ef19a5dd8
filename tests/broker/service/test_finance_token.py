"""The ``finance`` token kind (issue #12 item 7): reads every team's finance figures (usage summary, FOCUS export,
savings, budgets) and nothing else — every other operation of the API answers 403 (401 on the node API, which takes node
tokens only); a team token still sees its own team only. Over the hand-worked ledger of
:mod:`tests.broker.service.test_usage_api` (March 2024: alpha 10.6 USD on AWS and GCP, beta 6.6 USD on-prem)."""

from __future__ import annotations

import re

import pytest

from broker.service.api import create_app
from broker.service.budgets import set_budget
from broker.service.tokens import TokenForbidden, create_token
from broker.service.store.tokens import Principal
from tests.broker.service.test_usage_api import MARCH, figures, summary, world  # noqa: F401 (fixture)
from tests.conftest import auth

#: the operations a finance token may call (GET, every team's figures)
FINANCE_OPS = {("GET", "/v1/usage/summary"), ("GET", "/v1/usage/focus"), ("GET", "/v1/usage/savings"),
               ("GET", "/v1/budgets"), ("GET", "/v1/budgets/{team}")}
_PATHS = create_app(None).openapi()["paths"]
OPERATIONS = sorted((m.upper(), p) for p, ops in _PATHS.items() for m in ops)


@pytest.fixture
def fin(world, any_store):  # noqa: F811
    set_budget(any_store, world["alpha"], 40.0)
    set_budget(any_store, world["beta"], 5.0)
    return {**world, "fin": auth(create_token(any_store, "finance-office", "finance", label="cfo").token)}


def test_a_finance_token_reads_every_teams_totals(fin):
    a, b = fin["alpha"], fin["beta"]
    out = summary(fin, "fin", by="team")
    assert out["team"] is None
    assert [figures(g) for g in out["groups"]] == [(a, 10.6, 4.1, 2.1, 0.54, 2), (b, 6.6, 5.0, 3.0, 0.6, 3)]
    assert figures(out["total"])[1] == 17.2
    # it may narrow to one team, as an admin may
    assert [g["key"] for g in summary(fin, "fin", by="team", team=b)["groups"]] == [b]
    r = fin["c"].get("/v1/usage/focus", params=MARCH, headers=fin["fin"])
    assert r.status_code == 200 and a in r.text and b in r.text
    r = fin["c"].get("/v1/usage/savings", params=MARCH, headers=fin["fin"])
    assert r.status_code == 200 and r.json()["team"] is None and r.json()["units"] + r.json()["not_compared_units"] == 4
    r = fin["c"].get("/v1/budgets", headers=fin["fin"])
    assert r.status_code == 200 and {x["team"]: x["cap_usd"] for x in r.json()} == {a: 40.0, b: 5.0}
    assert fin["c"].get(f"/v1/budgets/{b}", headers=fin["fin"]).json()["cap_usd"] == 5.0


def test_a_team_token_still_sees_its_own_team_only(fin):
    out = summary(fin, "alpha_ro", by="team")
    assert [g["key"] for g in out["groups"]] == [fin["alpha"]]
    assert [x["team"] for x in fin["c"].get("/v1/budgets", headers=fin["alpha_ro"]).json()] == [fin["alpha"]]
    assert fin["c"].get(f"/v1/budgets/{fin['beta']}", headers=fin["alpha_ro"]).status_code == 404


def _url(path: str) -> str:
    return re.sub(r"\{[^}]+\}", lambda m: {"{job_id}": "job-0123456789abcdef", "{schedule_id}": "sch-0123456789abcdef",
                                           "{token_id}": "tok-0123456789abcdef"}.get(m.group(0), "x1"), path)


@pytest.mark.parametrize("method,path", [op for op in OPERATIONS if op not in FINANCE_OPS],
                         ids=[f"{m} {p}" for m, p in OPERATIONS if (m, p) not in FINANCE_OPS])
def test_a_finance_token_is_refused_everywhere_else(fin, method, path):
    """Every write route, job logs, jobs, schedules, token operations, the audit log, /metrics: 403; the node
    API (node tokens only): 401 or 403; the instance report route (instance tokens only, no cloud configured
    here): 401, 403 or 404; /healthz needs no token at all."""
    r = fin["c"].request(method, _url(path), headers=fin["fin"], json={})
    if path == "/healthz":
        assert r.status_code in (200, 503)
    elif path.startswith("/v1/node/"):
        assert r.status_code in (401, 403), r.text
    elif path == "/v1/instances/report":  # takes an instance's own token, not an API token; no cloud here
        assert r.status_code in (401, 403, 404), r.text
    else:
        assert r.status_code == 403, (r.status_code, r.text)
        assert "a finance token may only read the finance routes" in r.json()["detail"]


def test_only_an_admin_creates_a_finance_token(any_store):
    from broker.service.tokens import create_token as mint

    admin = Principal("ops", kind="admin")
    assert mint(any_store, "finance-office", "finance", actor=admin).token
    lead = Principal("alpha", kind="team-admin")
    with pytest.raises(TokenForbidden, match=r"kind='finance': a team admin may create only member, read-only"):
        mint(any_store, "alpha", "finance", actor=lead)
