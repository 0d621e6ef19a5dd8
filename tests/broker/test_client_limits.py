"""The SDK against a live uvicorn server with the rate limit on (real PostgreSQL and Redis):
it waits out 429 answers by their Retry-After, raises RateLimited past its budget, and
submit_many sends sweeps through POST /v1/jobs:batch."""

from __future__ import annotations

import time
import uuid

import pytest

from broker.service.api import create_app
from broker.client import Client, RateLimited, ValidationFailed
from broker.service.limits import RateLimiter
from broker.service.settings import BrokerSettings, QuotaSettings
from broker.service.tokens import create_token
from tests.broker.harness import ServerThread, count_jobs
from tests.conftest import REDIS_URL

SPEC = {"command": ["/bin/true"], "gpus_per_node": 1, "estimated_duration_s": 60}


@pytest.fixture(scope="module")
def store(module_pg_store):
    return module_pg_store


@pytest.fixture(scope="module")
def server(store):
    # 2 submits/s, bucket of 2; at most 4 unfinished jobs per team, except team "sweep"
    quotas = QuotaSettings(submits_per_s=2, burst=2, max_queued_jobs=4, quota_retry_after_s=1,
                           per_team={"sweep": {"submits_per_s": 0, "max_queued_jobs": 2500},
                                     "slow": {"submits_per_s": 0.1}})
    limiter = RateLimiter(REDIS_URL, quotas, prefix=f"test:{uuid.uuid4().hex[:8]}:")
    with ServerThread(create_app(store, BrokerSettings.model_construct(quotas=quotas), rate_limiter=limiter)) as srv:
        yield srv


def _client(store, server, team: str | None = None, **kw) -> tuple[str, Client]:
    team = team or "t" + uuid.uuid4().hex[:10]
    return team, Client(server.url, create_token(store, team).token, **kw)


def test_submit_waits_out_429_by_retry_after(store, server):
    team, c = _client(store, server)
    t0 = time.monotonic()
    ids = [c.submit(SPEC).id for _ in range(3)]  # the third waits ~1 s (Retry-After: 1)
    took = time.monotonic() - t0
    assert len(set(ids)) == 3 and count_jobs(store, team) == 3
    assert 0.9 <= took < 5


def test_rate_limited_after_the_wait_budget(store, server):
    team, c = _client(store, server, team="slow", max_rate_wait_s=0)
    c.submit(SPEC)
    c.submit(SPEC)
    with pytest.raises(RateLimited) as e:
        c.submit(SPEC)
    assert (e.value.status, e.value.retry_after, e.value.limit) == (429, 10.0, "quotas.submits_per_s")
    assert str(e.value).startswith(f"429 quotas.submits_per_s: team {team!r} may submit 0.1 jobs/s (burst 2)")


def test_quota_429_is_retried_then_raised(store, server):
    team, c = _client(store, server, max_rate_wait_s=2.5)
    for _ in range(4):
        c.submit(SPEC)
    t0 = time.monotonic()
    with pytest.raises(RateLimited) as e:
        c.submit(SPEC)  # the quota stays full: waits 1 s twice (Retry-After: 1), then gives up
    assert e.value.limit == "quotas.max_queued_jobs" and e.value.retry_after == 1.0
    assert 1.9 <= time.monotonic() - t0 < 6
    assert count_jobs(store, team) == 4


def test_submit_many_chunks_and_returns_per_item_results(store, server):
    _, c = _client(store, server, team="sweep")
    before = count_jobs(store, "sweep")
    specs = [{**SPEC, "name": f"s{i}"} for i in range(2300)]
    specs[1500] = {**SPEC, "gpus_per_node": 0}
    res = c.submit_many(specs)
    assert [r.index for r in res] == list(range(2300))
    assert [r.status for r in res].count(201) == 2299 and res[1500].status == 422
    assert res[1500].detail[0]["loc"] == ["body", "items", 500, "spec", "gpus_per_node"]  # index within its chunk
    assert res[2299].job.name == "s2299"
    assert count_jobs(store, "sweep") == before + 2299
    # the same keys again: every job answered, nothing new
    keys = [f"k{i}" for i in range(3)]
    first = c.submit_many(specs[:3], keys=keys)
    again = c.submit_many(specs[:3], keys=keys, chunk=2)
    assert [r.status for r in again] == [200, 200, 200]
    assert [r.job.id for r in again] == [r.job.id for r in first]
    with pytest.raises(ValidationFailed, match="keys: 2 keys for 3 specs"):
        c.submit_many(specs[:3], keys=keys[:2])
    with pytest.raises(ValueError, match="chunk=1001"):
        c.submit_many(specs[:3], chunk=1001)
