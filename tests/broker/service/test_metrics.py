"""GET /metrics (broker.service.metrics) on a real PostgreSQL schema: hand-counted series, team scoping,
token kinds, and the Grafana dashboard reading only metrics that exist."""

from __future__ import annotations

import json
import re
import uuid
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from broker.model import JobSpec
from broker.service.api import create_app
from broker.service.metrics import METRIC_NAMES
from broker.service.settings import BrokerSettings
from broker.service.budgets import set_budget
from broker.service.store.tables import Attempt, CloudInstance, Job, UsageRow
from broker.service.tokens import create_token
from tests.conftest import auth

ADMIN = "admin-secret-" + uuid.uuid4().hex
UTC = timezone.utc
DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "fedbroker.json"


def _spec():
    return JobSpec(command=["true"], estimated_duration_s=600.0,
                   deadline=(datetime.now(UTC) + timedelta(hours=30)).replace(microsecond=0))


@pytest.fixture
def seeded(any_store):
    """Team ``a``: one job queued for pool ``toronto`` and one that ran 2 GPUs on-prem for 2 h after waiting
    120 s; team ``b``: one job that ran 1 GPU on AWS spot for 30 min (one instance record, ``terminated``)."""
    st = any_store
    t0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    a1 = st.submit("a", _spec())[0].id
    a2 = st.submit("a", _spec())[0].id
    b1 = st.submit("b", _spec())[0].id
    with st.session() as s:
        s.execute(update(Job).where(Job.id == a1).values(state="queued", committed_pool="toronto"))
        s.execute(update(Job).where(Job.id == a2).values(state="succeeded", created_at=t0,
                                                         started_at=t0 + timedelta(seconds=120)))
        s.execute(update(Job).where(Job.id == b1).values(state="succeeded", created_at=t0,
                                                         started_at=t0 + timedelta(seconds=4000)))
        s.add(Attempt(job_id=a2, number=1, kind="onprem", pool="toronto", offer_id=None, nodes=[], gpu_type="V100",
                      gpus=2, created_at=t0, started_at=t0 + timedelta(seconds=120),
                      ended_at=t0 + timedelta(seconds=120 + 7200), rank_exits={}, reason=""))
        s.add(Attempt(job_id=b1, number=1, kind="cloud", pool=None, offer_id="aws:use1-az1:p3.2xlarge:spot", nodes=[],
                      gpu_type="V100", gpus=1, created_at=t0, started_at=t0 + timedelta(seconds=4000),
                      ended_at=t0 + timedelta(seconds=4000 + 1800), rank_exits={}, reason=""))
        s.add(CloudInstance(job_id=b1, attempt=1, rank=0, offer_id="aws:use1-az1:p3.2xlarge:spot", provider="aws",
                            region="us-east-1", zone="use1-az1", instance_type="p3.2xlarge", market="spot",
                            idempotency_token=uuid.uuid4().hex, state="terminated", created_at=t0, updated_at=t0,
                            history=[]))
        # ledger lines (hand-set figures): a's on-prem energy and amortised lines, b's AWS instance line with an
        # unknown carbon figure (left out of the carbon sum, not counted as 0)
        for job, line, prov, usd, kwh, kg in ((a2, "energy", "onprem", 0.132, 0.66, 0.05),
                                              (a2, "amortised", "onprem", 1.0, 0.0, 0.0),
                                              (b1, "instance", "aws", 0.051, 0.004, None)):
            s.add(UsageRow(job_id=job, attempt=1, rank=0, line=line, resource="r", team="a" if job == a2 else "b",
                           start=t0, end=t0 + timedelta(hours=1), provider=prov, gpu_type="V100", gpu_count=1,
                           run_s=3600.0, billed_s=3600.0, pricing_unit="Hours", billed_usd=usd, energy_kwh=kwh,
                           carbon_kg=kg, estimated=kg is None, estimate_reasons=[], source="live", recorded_at=t0))
    set_budget(st, "a", 100.0)
    app = create_app(st, BrokerSettings(admin_token=ADMIN))
    with TestClient(app) as c:
        yield st, c


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_admin_sees_every_team_with_hand_counted_values(seeded):
    _, c = seeded
    r = c.get("/metrics", headers=auth(ADMIN))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    assert m[("fedbroker_jobs", (("state", "queued"), ("team", "a")))] == 1
    assert m[("fedbroker_jobs", (("state", "succeeded"), ("team", "a")))] == 1
    assert m[("fedbroker_jobs", (("state", "succeeded"), ("team", "b")))] == 1
    assert m[("fedbroker_queue_depth", (("pool", "toronto"), ("team", "a")))] == 1
    assert m[("fedbroker_cloud_instances", (("provider", "aws"), ("state", "terminated")))] == 1
    # 2 GPUs x 7200 s = 4 GPU-h on-prem; 1 GPU x 1800 s = 0.5 GPU-h on AWS
    assert m[("fedbroker_attempt_gpu_hours", (("kind", "onprem"), ("place", "toronto"), ("team", "a")))] == 4.0
    assert m[("fedbroker_attempt_gpu_hours", (("kind", "cloud"), ("place", "aws"), ("team", "b")))] == 0.5
    # waits: a 120 s (buckets from 300 s up), b 4000 s (from 4 h up)
    assert m[("fedbroker_job_wait_seconds_bucket", (("le", "60.0"), ("team", "a")))] == 0
    assert m[("fedbroker_job_wait_seconds_bucket", (("le", "300.0"), ("team", "a")))] == 1
    assert m[("fedbroker_job_wait_seconds_bucket", (("le", "3600.0"), ("team", "b")))] == 0
    assert m[("fedbroker_job_wait_seconds_bucket", (("le", "14400.0"), ("team", "b")))] == 1
    assert m[("fedbroker_job_wait_seconds_sum", (("team", "a"),))] == 120.0
    assert m[("fedbroker_job_wait_seconds_count", (("team", "b"),))] == 1
    # the ledger's sums per (team, provider, line), and team a's budget (no cloud spend this month)
    assert m[("fedbroker_usage_cost_usd_total", (("line", "energy"), ("provider", "onprem"), ("team", "a")))] == 0.132
    assert m[("fedbroker_usage_cost_usd_total", (("line", "amortised"), ("provider", "onprem"), ("team", "a")))] == 1.0
    assert m[("fedbroker_usage_energy_kwh_total", (("line", "instance"), ("provider", "aws"), ("team", "b")))] == 0.004
    assert ("fedbroker_usage_carbon_kg_total", (("line", "instance"), ("provider", "aws"), ("team", "b"))) not in m
    assert m[("fedbroker_usage_carbon_kg_total", (("line", "energy"), ("provider", "onprem"), ("team", "a")))] == 0.05
    assert m[("fedbroker_budget_cap_usd", (("team", "a"),))] == 100.0
    assert m[("fedbroker_budget_spent_usd", (("team", "a"),))] == 0.0
    assert m[("fedbroker_budget_committed_usd", (("team", "a"),))] == 0.0


def test_a_team_token_sees_only_its_team(seeded):
    st, c = seeded
    for kind in ("member", "read-only"):
        r = c.get("/metrics", headers=auth(create_token(st, "a", kind, label="t").token))
        assert r.status_code == 200
        teams = set(re.findall(r'team="([^"]*)"', r.text))
        assert teams == {"a"}, kind
        assert "fedbroker_cloud_instances{" not in r.text  # team a has no instances; b's are not shown


def test_no_token_401_and_node_token_403(seeded):
    st, c = seeded
    assert c.get("/metrics").status_code == 401
    node = create_token(st, "ops", "node", node="n1", label="agent").token
    r = c.get("/metrics", headers=auth(node))
    assert r.status_code == 403 and "node token" in r.json()["detail"]


def test_grafana_dashboard_reads_only_metrics_the_endpoint_serves(seeded):
    _, c = seeded
    served = {fam.name for fam in text_string_to_metric_families(c.get("/metrics", headers=auth(ADMIN)).text)}
    assert served == set(METRIC_NAMES)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has queries"
    used = {re.sub(r"_(bucket|sum|count|total)$", "", n) for e in exprs for n in re.findall(r"\bfedbroker_\w+", e)}
    assert used and used <= served, used - served
    assert used == served  # every metric has a panel


def test_scrape_cache_reuses_a_scope_for_its_ttl_then_reads_again(seeded):
    from broker.service.metrics import ScrapeCache

    st, _ = seeded
    cache = ScrapeCache(st, ttl_s=10.0)
    t = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    first = cache.get("a", t)
    st.submit("a", _spec())  # a new job of team a
    assert cache.get("a", t + timedelta(seconds=9.9)) == first  # within the TTL: the same answer
    fresh = _samples(cache.get("a", t + timedelta(seconds=10)).decode())
    assert fresh[("fedbroker_jobs", (("state", "submitted"), ("team", "a")))] == 1
    assert cache.get("b", t) != first  # scopes are cached apart
