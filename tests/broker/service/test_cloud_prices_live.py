"""Live cloud prices in the live broker: the refresh task fetches AWS spot history, the AWS Price List and the
GCP Cloud Billing Catalog (botocore Stubber + ``responses``: no test reaches the network) into the signal cache
once per period, and the live environment re-prices the bundled offers from it, saying where each price came
from; feeds down -> last known, then the bundled catalog."""

from __future__ import annotations

import pytest
import requests
import responses
from botocore.stub import Stubber

from broker.service.live import LiveEnvironment
from broker.service.settings import BrokerSettings
from broker.service.signal_settings import SignalsSettings
from broker.service.store import signals as rows
from pricing.catalog import load_offers
from pricing.cloud_price_sources import (AWS_PRICE_LIST, AWS_SPOT, BUNDLED_CATALOG, GCP_BILLING_CATALOG,
                                         AwsPriceList, AwsSpotPrices, GcpBillingCatalog, _aws_client)
from tests.broker.service.signals_setup import Clock, Sleeps, cache, drop
from tests.pricing.recorded import utc
from tests.pricing.test_cloud_price_sources import _fake_aws_credentials, _price_doc, _rec, _register_pages  # noqa: F401

H = 3600.0
#: the fake "now": 2024-06-03 12:30 UTC
T = utc(2024, 6, 3, 12, 30)
US_EAST_1 = sorted({o.instance_type for o in load_offers(("aws",)).offers if o.region == "us-east-1"})


def _settings() -> SignalsSettings:
    fast = {"requests_per_s": 100, "burst": 100, "max_retries": 1, "backoff_s": 2.0, "max_backoff_s": 30.0}
    return SignalsSettings.model_validate({
        "cloud_prices": {"aws": ["us-east-1"], "gcp": ["us-central1"], "refresh_s": 3600, "stale_after_s": 7200,
                         "spot_history_h": 2},
        "sources": {AWS_SPOT: fast, AWS_PRICE_LIST: fast, GCP_BILLING_CATALOG: fast}})


def _spot_page():
    # use1-az1 p3.2xlarge: 0.90 since 09:00, jumps to 1.50 at 12:15 -> 12:00-12:30 averages 1.20 (estimated)
    return {"SpotPriceHistory": [_rec("use1-az1", "us-east-1a", "p3.2xlarge", "1.500000", utc(2024, 6, 3, 12, 15)),
                                 _rec("use1-az1", "us-east-1a", "p3.2xlarge", "0.900000", utc(2024, 6, 3, 9))]}


def _price_list_pages(stub):
    for it in US_EAST_1:
        docs = [_price_doc("p3.2xlarge", "us-east-1", 3.21)] if it == "p3.2xlarge" else []
        stub.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": docs})


@pytest.fixture
def parts(any_store):
    clock = Clock(T)
    sleeps = Sleeps()
    ec2, pricing = _aws_client("ec2", "us-east-1", 5.0), _aws_client("pricing", "us-east-1", 5.0)
    srcs = {(AWS_SPOT, ""): AwsSpotPrices(lambda region: ec2, clock=clock), (AWS_PRICE_LIST, ""): AwsPriceList(pricing),
            (GCP_BILLING_CATALOG, ""): GcpBillingCatalog(session=requests.Session())}
    c = cache(any_store, _settings(), clock)
    c.sleep = sleeps  # (an empty Sleeps is falsy: cache() would make its own)
    c._sources.update(srcs)
    with responses.RequestsMock() as rsps:
        yield c, clock, sleeps, Stubber(ec2), Stubber(pricing), rsps
    drop(c)


def _offer(env, now, oid):
    return next(o for o in env.offers_at(now) if o.offer_id == oid)


def test_refresh_then_the_live_environment_reprices_and_explains(parts):
    c, clock, sleeps, ec2, pricing, rsps = parts
    ec2.add_response("describe_spot_price_history", _spot_page())
    _price_list_pages(pricing)
    _register_pages(rsps)
    with ec2, pricing:
        res = {r.zone: r for r in c.refresh_cloud()}
        again = c.refresh_cloud()  # same period: another process (or tick) does not fetch again
    ec2.assert_no_pending_responses()
    pricing.assert_no_pending_responses()
    assert [r.claimed for r in again] == [False, False]
    # spot: 3 hours (10, 11, 12) of the one zone/type AWS answered for; on-demand: p3.2xlarge's 4 us-east-1 zones
    assert res["aws"].fetched == {AWS_SPOT: 3, AWS_PRICE_LIST: 4} and res["aws"].errors == {}
    assert res["gcp"].fetched[GCP_BILLING_CATALOG] >= 1 and res["gcp"].errors == {}

    env = LiveEnvironment(BrokerSettings().planner, signals=(c.settings, c))
    now = T.timestamp()
    spot = _offer(env, now, "aws:use1-az1:p3.2xlarge:spot")
    assert spot.usd_per_hour == pytest.approx((15 * 0.9 + 15 * 1.5) / 30, rel=1e-12)  # 1.20
    assert env.cloud_price_note(spot, now) == {
        "offer_id": "aws:use1-az1:p3.2xlarge:spot", "source": AWS_SPOT, "usd_per_hour": spot.usd_per_hour,
        "age_s": 0.0, "last_known": False, "estimated": True, "fallback": False,
        "note": "aws:use1-az1:p3.2xlarge:spot: aws-spot-history, 0.0 h old"}
    assert _offer(env, now, "aws:use1-az1:p3.2xlarge:on_demand").usd_per_hour == 3.21
    assert _offer(env, now, "gcp:us-central1-a:n1-standard-4+T4x1:on_demand").usd_per_hour == pytest.approx(
        0.589999, rel=1e-12)
    # no live price for it (AWS sent no use1-az2 record): the bundled catalog price, flagged as a fallback
    az2 = _offer(env, now, "aws:use1-az2:p3.2xlarge:spot")
    assert az2.usd_per_hour == 0.3709
    note = env.cloud_price_note(az2, now)
    assert (note["source"], note["fallback"], note["age_s"]) == (BUNDLED_CATALOG, True, None)
    # a region cloud_prices does not list keeps the catalog, not flagged as a failed live price
    west = next(o for o in env.offers_at(now) if o.provider == "aws" and o.region == "us-west-2")
    assert env.cloud_price_note(west, now)["fallback"] is False
    assert [o.offer_id for o in env.offers_at(now)] == [o.offer_id for o in env.offers]  # same order: indexes hold
    assert env.context([], now).offers[env.offers.index(spot.model_copy(update={"usd_per_hour": 0.3644}))] == spot

    # three hours later the feeds are down (AWS throttles twice, GCP answers 503 twice): last-known prices, said so
    clock.t += 3 * H
    ec2.add_client_error("describe_spot_price_history", service_error_code="RequestLimitExceeded",
                         http_status_code=503)
    ec2.add_client_error("describe_spot_price_history", service_error_code="RequestLimitExceeded",
                         http_status_code=503)
    pricing.add_client_error("get_products", service_error_code="AccessDeniedException", http_status_code=400)
    rsps.reset()
    rsps.get("https://cloudbilling.googleapis.com/v1/services/6F81-5844-456A/skus", status=503)
    with ec2, pricing:
        res = {r.zone: r for r in c.refresh_cloud(force=True)}  # the claim's TTL runs on Redis' clock, not the fake
    assert res["aws"].errors[AWS_SPOT].startswith("rate_limited: describe_spot_price_history: RequestLimitExceeded")
    assert res["aws"].errors[AWS_PRICE_LIST].startswith("auth: get_products: AccessDeniedException")
    assert res["gcp"].errors[GCP_BILLING_CATALOG] == "unavailable: GET /v1/services/6F81-5844-456A/skus: HTTP 503"
    assert sleeps == [2.0, 2.0]  # one retry each of the throttled spot call and the GCP 5xx (max_retries 1)
    assert c.backoff_until(AWS_SPOT) == pytest.approx(clock.t + 4.0)  # retries used up: back off 2 x 2^1 s
    now = clock.t
    env = LiveEnvironment(BrokerSettings().planner, signals=(c.settings, c))
    spot = _offer(env, now, "aws:use1-az1:p3.2xlarge:spot")
    assert spot.usd_per_hour == pytest.approx(1.2, rel=1e-12)  # the last cached hour, 12:00
    note = env.cloud_price_note(spot, now)
    assert (note["source"], note["age_s"], note["last_known"], note["fallback"]) == (AWS_SPOT, 3 * H, True, False)
    assert note["note"].endswith("3.0 h old (last known: older than the staleness limit)")
    with c.store.session() as s:
        health = {(f.source, f.zone): (f.last_error, dict(f.error_counts or {})) for f in rows.fetch_rows(s)
                  if f.kind == "cloud"}
    assert health[(AWS_SPOT, "aws")][1] == {"rate_limited": 1}
    assert health[(AWS_PRICE_LIST, "aws")][1] == {"auth": 1}
    assert health[(GCP_BILLING_CATALOG, "gcp")][1] == {"unavailable": 1}
    status = {(e["zone"], e["source"]): e for e in c.health() if e["kind"] == "cloud"}
    assert status[("aws", AWS_SPOT)]["health"] == "backing off until 2024-06-03T15:30:04+00:00"  # 15:30 + 2 x 2^1 s
    assert status[("aws", AWS_PRICE_LIST)]["health"] == "stale (older than 7200 s)"
    assert status[("gcp", GCP_BILLING_CATALOG)]["errors"] == {"unavailable": 1}
    assert status[("gcp", GCP_BILLING_CATALOG)]["age_s"] == 3 * H
    # /metrics reads the same rows: the cloud sources' age, the provider's fallback flag and the error counters
    from broker.service.metrics import signal_families

    age, fallback, errors = signal_families(c.store, now)
    assert {tuple(x.labels.values()): x.value for x in age.samples if x.labels["kind"] == "cloud"} == {
        ("aws", "cloud", AWS_PRICE_LIST): 3 * H, ("aws", "cloud", AWS_SPOT): 3 * H,
        ("gcp", "cloud", GCP_BILLING_CATALOG): 3 * H}
    assert {x.labels["zone"]: x.value for x in fallback.samples if x.labels["kind"] == "cloud"} == {"aws": 1.0,
                                                                                                   "gcp": 1.0}
    assert {(x.labels["source"], x.labels["error"]): x.value for x in errors.samples
            if x.name.endswith("_total")} == {(AWS_SPOT, "rate_limited"): 1.0, (AWS_PRICE_LIST, "auth"): 1.0,
                                              (GCP_BILLING_CATALOG, "unavailable"): 1.0}


def test_without_cloud_prices_every_offer_keeps_the_catalog_price(any_store):
    c = cache(any_store, SignalsSettings(), Clock(T))
    try:
        env = LiveEnvironment(BrokerSettings().planner, signals=(c.settings, c))
        assert env.offers_at(T.timestamp()) is env.offers
        assert env.cloud_price_note(env.offers[0], T.timestamp()) is None
        assert c.refresh_cloud() == []
    finally:
        drop(c)


def test_a_provisioning_decision_says_which_price_source_and_how_old(pg_store):
    """End to end through the planning cycle: a live spot price far below the catalog wins the placement, and the
    decision's explain record names its source and age."""
    import time
    from datetime import datetime, timezone

    from broker.model import JobSpec
    from broker.service.cycle import PlanningCycle
    from broker.service.store.signals import CachedHour

    c = cache(pg_store, _settings(), time.time)
    try:
        now = time.time()
        h = datetime.fromtimestamp(now // 3600 * 3600, tz=timezone.utc)
        oid = "aws:use1-az1:p3.2xlarge:spot"
        with pg_store.session() as s:
            rows.put_values(s, "cloud", "USD/h", [CachedHour(AWS_SPOT, oid, h, 0.01, False, False,
                                                             datetime.fromtimestamp(now - 120, tz=timezone.utc))])
        c._mirror(AWS_SPOT, oid, h.timestamp(), h.timestamp() + H)
        st = BrokerSettings()
        env = LiveEnvironment(st.planner, providers=["aws"], signals=(c.settings, c))
        cyc = PlanningCycle(pg_store, env, st, dispatch=lambda j, a: None)
        jid = pg_store.submit("ml", JobSpec(image="ghcr.io/fedbroker/nccl-train@sha256:" + "ab" * 32,
                                            command=["python", "train.py"], gpu_types=["V100"],
                                            estimated_duration_s=3600.0))[0].id
        cyc.run()
        j = pg_store.get(jid)
        assert j.state == "provisioning" and j.placement["offer_id"] == oid
        got = pg_store.decision(jid)["cloud_price"]
        assert (got["offer_id"], got["source"], got["usd_per_hour"], got["fallback"], got["last_known"]) == (
            oid, AWS_SPOT, 0.01, False, False)
        assert got["age_s"] == pytest.approx(120.0, abs=30.0)
    finally:
        drop(c)


def test_provisioning_fails_over_in_live_price_order(sqlite_store):
    """The cloud broker takes its failover options from the live environment's priced offers: a zone whose live
    spot price fell below the others' catalog prices comes first after the planner's choice."""
    import time
    from datetime import datetime, timezone

    from broker.service.cloud import CloudBroker
    from broker.service.cloud.provision import failover_options
    from broker.service.store.signals import CachedHour

    c = cache(sqlite_store, _settings(), time.time)
    try:
        now = time.time()
        h = datetime.fromtimestamp(now // 3600 * 3600, tz=timezone.utc)
        cheap = "aws:use1-az6:p3.2xlarge:spot"  # catalog 0.3718
        with sqlite_store.session() as s:
            rows.put_values(s, "cloud", "USD/h", [CachedHour(AWS_SPOT, cheap, h, 0.05, False, False,
                                                             datetime.fromtimestamp(now - 60, tz=timezone.utc))])
        c._mirror(AWS_SPOT, cheap, h.timestamp(), h.timestamp() + H)
        st = BrokerSettings()
        env = LiveEnvironment(st.planner, providers=["aws"], signals=(c.settings, c))
        cb = CloudBroker(sqlite_store, st, offers=env.offers, computes={}, priced=env.offers_at)
        spec = {"gpus_per_node": 1, "nodes": 1, "gpu_types": ["V100"], "allowed_regions": ["us-east-1"]}
        ids = lambda offers: [o.offer_id for o in failover_options(  # noqa: E731
            offers, "aws:use1-az1:p3.2xlarge:spot", spec, lambda o: True, limit=4)]
        a1, a2, a5 = (f"aws:use1-az{k}:p3.2xlarge:spot" for k in (1, 2, 5))
        # catalog spot $/h: az2 0.3709 < az6 0.3718 < az5 0.3764 (az1, the planner's choice, first)
        assert ids(cb.offers) == [a1, a2, cheap, a5]
        assert ids(cb.offers_at(now)) == [a1, cheap, a2, a5]  # az6 live at 0.05
    finally:
        drop(c)
