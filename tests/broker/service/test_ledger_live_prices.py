"""The usage ledger bills with the live prices and signals the live planner used (issues #12/#13): cloud compute
hour by hour at the cached live price in force, else the launch price recorded at the create call, else the
catalog price (flagged); on-prem energy and carbon from the live signal chain of the pool's zones (fresh measured
values unflagged; last-known values flagged). Real PostgreSQL/SQLite and Redis; the cache is filled as the refresh
task would (database rows mirrored to Redis). Every figure is worked by hand in the comments."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import update

from broker.service import ledger, lifecycle
from broker.service.live import LiveEnvironment
from broker.service.settings import BrokerSettings
from broker.service.signal_settings import SignalsSettings
from broker.service.store import attempts as repo
from broker.service.store import signals as rows
from broker.service.store.signals import CachedHour
from broker.service.store.tables import CloudInstance, Job
from broker.usage import UsageRecord
from pricing.cloud_price_sources import AWS_PRICE_LIST, AWS_SPOT
from tests.broker.service import test_cloud as tc
from tests.broker.service import test_ledger as tl
from tests.broker.service.test_cloud import net, settings  # noqa: F401 (fixtures: moto EC2 and its settings)
from tests.broker.service.signals_setup import Clock, cache, drop

UTC = timezone.utc
H = 3600.0
DAY0 = tl.DAY0  # 2024-03-05 UTC
#: the instances of the cloud tests: created 09:30, the job ends 11:15 -> 6300 s, billed 6300 s (per second)
C0, C1 = DAY0 + timedelta(hours=9, minutes=30), DAY0 + timedelta(hours=11, minutes=15)


def _cloud_settings() -> SignalsSettings:
    return SignalsSettings.model_validate({"cloud_prices": {"aws": ["us-east-1"], "refresh_s": 3600,
                                                            "stale_after_s": 7200, "spot_history_h": 2}})


def _put(store, c, kind: str, unit: str, source: str, zone: str, values: dict[int, float], fetched: datetime,
         forecast: bool = False) -> None:
    """Cache ``values`` (hour of DAY0 -> value) of (source, zone) as the refresh task would: database, then Redis."""
    with store.session() as s:
        rows.put_values(s, kind, unit, [CachedHour(source, zone, DAY0 + timedelta(hours=h), v, False, forecast,
                                                   fetched) for h, v in values.items()])
    c._mirror(source, zone, DAY0.timestamp(), DAY0.timestamp() + 24 * H)


@pytest.fixture
def cloud_cache(any_store):
    tl.install()
    c = cache(any_store, _cloud_settings(), Clock(DAY0 + timedelta(hours=12)))
    ledger.install(replace(ledger.prices(), cloud_cache=c))
    yield c
    ledger.install(None)
    drop(c)


def _bill_instance(store, offer, launch_usd_per_hour: float | None) -> UsageRecord:
    jid = tl.cloud_job(store, offer, C0)
    with store.session() as s:
        s.execute(update(CloudInstance).where(CloudInstance.job_id == jid).values(
            launch_usd_per_hour=launch_usd_per_hour))
    assert tl.run_ranks(store, jid, 1, C0 + timedelta(seconds=90), [(0, 0, C1)]) == ["succeeded"]
    [r] = tl.records(store, jid)
    assert (r.line, r.start, r.end, r.run_s, r.billed_s) == ("instance", C0, C1, 6300.0, 6300.0)
    return r


def _price_reasons(r: UsageRecord) -> list[str]:
    return [w for w in r.estimate_reasons if w.startswith("compute price")]


def test_a_spot_instance_across_a_price_jump_is_billed_per_hour_at_the_cached_prices(any_store, cloud_cache):
    # the spot history, time-weighted per hour: 09:00 0.90, 10:00 1.20 (the jump to 1.50 at 10:30), 11:00 1.50 USD/h
    _put(any_store, cloud_cache, "cloud", "USD/h", AWS_SPOT, tl.AWS_SPOT.offer_id, {9: 0.90, 10: 1.20, 11: 1.50},
         DAY0 + timedelta(hours=11, minutes=50))
    r = _bill_instance(any_store, tl.AWS_SPOT, 0.90)  # launch price: the planner's 0.90 at 09:30
    # 09:30-10:00 1800 s x 0.90/3600 = 0.45; 10:00-11:00 3600 s x 1.20/3600 = 1.20; 11:00-11:15 900 s x 1.50/3600
    # = 0.375 -> 2.025 USD (the launch price alone would say 6300 x 0.90 / 3600 = 1.575)
    assert r.billed_usd == pytest.approx(2.025, abs=1e-12)
    # the line's list price: the mean over its billed hours, 2.025 / 1.75 h = 1.157142857 USD/h
    assert r.list_unit_price_usd == pytest.approx(2.025 / 1.75, abs=1e-12)
    assert r.price_source == AWS_SPOT and _price_reasons(r) == []


def test_an_on_demand_instance_bills_the_live_list_price_at_launch(any_store, cloud_cache):
    # the Price List price cached for 09:00 (the launch hour) is 3.21; a later one (10:00: 3.50) does not apply
    _put(any_store, cloud_cache, "cloud", "USD/h", AWS_PRICE_LIST, tl.AWS_OD.offer_id, {9: 3.21, 10: 3.50},
         DAY0 + timedelta(hours=10, minutes=5))
    r = _bill_instance(any_store, tl.AWS_OD, 3.06)
    # 6300 s x 3.21 / 3600 = 5.6175 USD
    assert r.billed_usd == pytest.approx(5.6175, abs=1e-12)
    assert (r.list_unit_price_usd, r.price_source, _price_reasons(r)) == (3.21, AWS_PRICE_LIST, [])


def test_hours_the_cache_lacks_are_billed_at_the_launch_price_recorded_at_create_flagged(any_store, cloud_cache):
    _put(any_store, cloud_cache, "cloud", "USD/h", AWS_SPOT, tl.AWS_SPOT.offer_id, {9: 0.90},
         DAY0 + timedelta(hours=9, minutes=50))  # the feed went down after 09:00's price
    r = _bill_instance(any_store, tl.AWS_SPOT, 1.10)  # the provisioner priced the offer at 1.10 USD/h at 09:30
    # 09:30-10:00 1800 s x 0.90/3600 = 0.45; 10:00-11:15 4500 s x 1.10/3600 = 1.375 -> 1.825 USD
    assert r.billed_usd == pytest.approx(1.825, abs=1e-12)
    assert r.price_source == f"{AWS_SPOT}+{ledger.LAUNCH_PRICE}"
    assert r.estimated and _price_reasons(r) == [
        "compute price: 2 of 3 h not the live price in force (launch-price 2 h)"]


def test_no_cached_price_and_no_launch_price_bills_the_catalog_flagged(any_store, cloud_cache):
    r = _bill_instance(any_store, tl.AWS_SPOT, None)  # a row written before migration 0013
    # the catalog's 0.90 USD/h x 6300 s / 3600 = 1.575 USD
    assert r.billed_usd == pytest.approx(1.575, abs=1e-12)
    assert (r.list_unit_price_usd, r.price_source) == (0.90, "bundled-catalog")
    assert r.estimated and _price_reasons(r) == [
        "compute price: 3 of 3 h not the live price in force (bundled-catalog 3 h)"]


def test_without_live_cloud_prices_the_launch_price_is_the_price_in_force(any_store):
    tl.install()  # no cloud_cache: the planner priced offers at the catalog, and so does the bill
    try:
        r = _bill_instance(any_store, tl.AWS_SPOT, 0.90)
        assert r.billed_usd == pytest.approx(1.575, abs=1e-12)  # 6300 s x 0.90 / 3600
        assert (r.price_source, _price_reasons(r)) == (ledger.LAUNCH_PRICE, [])
    finally:
        ledger.install(None)


def test_the_provisioner_records_the_price_it_launched_at(pg_store, settings):
    """The cloud broker keeps on each intent row the USD/h the option was priced at when it launched (its
    ``priced`` offers: the live environment's re-priced ones), not the catalog's."""
    from sqlalchemy import select

    from broker.service.cloud import CloudBroker

    o = tc.OFFERS[0]
    live = [x.model_copy(update={"usd_per_hour": 0.4321}) if x.offer_id == o.offer_id else x for x in tc.OFFERS]
    cb = CloudBroker(pg_store, settings, offers=tc.OFFERS, computes={"aws": tc.adapter(settings)},
                     priced=lambda now_s: live)
    jid = tc.place(pg_store, tc.spec(nodes=1), o)
    assert cb.provision(jid, 1) == f"starting on {o.offer_id} (1 instance(s))"
    with pg_store.session() as s:
        [row] = s.execute(select(CloudInstance).where(CloudInstance.job_id == jid)).scalars().all()
        assert (row.offer_id, row.launch_usd_per_hour) == (o.offer_id, 0.4321)
    assert o.usd_per_hour != 0.4321


# ----------------------------------------------------------------------------- on-prem
#: the on-prem job: 14:30 -> 15:30 on 2 V100s of the bundled live cluster's pool ``local`` (CA-ON, PUE 1.3)
T0, T1 = DAY0 + timedelta(hours=14, minutes=30), DAY0 + timedelta(hours=15, minutes=30)


def _onprem_settings() -> SignalsSettings:
    return SignalsSettings.model_validate({
        "zones": {"CA-ON": {"carbon": ["electricitymaps", "bundled"], "price": ["tariff", "bundled"]}},
        "tariffs": {"CA-ON": {"timezone": "America/Toronto", "currency": "USD", "per": "kWh", "default": 0.1}},
        "history_h": 3, "forecast_h": 3, "refresh_s": 900, "stale_after_s": 1800})


@pytest.fixture
def live_env(any_store):
    c = cache(any_store, _onprem_settings(), Clock(T1))
    env = LiveEnvironment(BrokerSettings().planner, signals=(c.settings, c))
    ledger.install(ledger.LedgerPrices.from_environment(env))
    yield c
    ledger.install(None)
    drop(c)


def _run_onprem(store) -> UsageRecord:
    with store.session() as s:
        tl._node(s, "n1", "local", T0, [5_000_000, 7_000_000], [250.0, 300.0])
    jid = tl.onprem_job(store, "local", "n1", [0, 1], T0)
    with store.session() as s:
        j, att = s.get(Job, jid), repo.attempt_row(s, jid, 1)
        assert lifecycle.mark_running(s, j, att, T0, "running on n1")
    with store.session() as s:  # an hour later: GPU 0 drew 900 kJ (250 W), GPU 1 1080 kJ (300 W)
        tl._node(s, "n1", "local", T1, [905_000_000, 1_087_000_000], [250.0, 300.0])
    assert tl.run_ranks(store, jid, 1, T0, [(0, 0, T1)], cloud=False) == ["succeeded"]
    [energy] = [r for r in tl.records(store, jid) if r.line == "energy"]
    # IT 0.25 + 0.30 = 0.55 kWh over the hour; x PUE 1.3 = 0.715 kWh (0.715 kW for 1 h)
    assert energy.energy_kwh == pytest.approx(0.715, rel=1e-12)
    return energy


def test_an_onprem_job_is_priced_from_the_live_tariff_and_carbon_feeds(any_store, live_env):
    # each hour fetched as it ended (14:59) or during it (15:20): fresh *for that hour* (stale_after_s 30 min),
    # though 14:59 is 31 min before the job's end, when the bill is written
    for h, price, carbon, at in ((14, 100.0, 30.0, (14, 59)), (15, 300.0, 50.0, (15, 20))):
        fetched = DAY0 + timedelta(hours=at[0], minutes=at[1])
        _put(any_store, live_env, "price", "USD/MWh", "tariff", "CA-ON", {h: price}, fetched)
        _put(any_store, live_env, "carbon", "gCO2e/kWh", "electricitymaps", "CA-ON", {h: carbon}, fetched)
    e = _run_onprem(any_store)
    # tariff: 30 min at 100 + 30 min at 300 USD/MWh = 200 USD/MWh x h; 0.715 kW x 200 / 1000 = 0.143 USD
    assert e.billed_usd == pytest.approx(0.143, rel=1e-12)
    assert e.list_unit_price_usd == pytest.approx(0.2, rel=1e-12)  # the mean tariff, USD/kWh
    # carbon: 0.715 kW x (0.5 h x 30 + 0.5 h x 50) gCO2e/kWh = 28.6 g = 0.0286 kgCO2e
    assert e.carbon_kg == pytest.approx(0.0286, rel=1e-12)
    assert (e.price_source, e.estimated, e.estimate_reasons) == ("tariff", False, ())


def test_the_same_job_with_the_feeds_down_is_priced_from_last_known_values_flagged(any_store, live_env):
    at = DAY0 + timedelta(hours=9)  # the feeds' last answer, 6 h before the job: older than stale_after_s (30 min)
    _put(any_store, live_env, "price", "USD/MWh", "tariff", "CA-ON", {14: 120.0, 15: 320.0}, at)
    _put(any_store, live_env, "carbon", "gCO2e/kWh", "electricitymaps", "CA-ON", {14: 36.0, 15: 60.0}, at,
         forecast=True)
    e = _run_onprem(any_store)
    # tariff: 0.5 x 120 + 0.5 x 320 = 220 USD/MWh x h; 0.715 x 220 / 1000 = 0.1573 USD
    assert e.billed_usd == pytest.approx(0.1573, rel=1e-12)
    # carbon: 0.715 x (0.5 x 36 + 0.5 x 60) = 0.715 x 48 g = 0.03432 kgCO2e
    assert e.carbon_kg == pytest.approx(0.03432, rel=1e-12)
    assert (e.price_source, e.estimated) == ("last-known:tariff", True)
    assert e.estimate_reasons == (
        "electricity price CA-ON: 2 of 2 h not measured (last-known:tariff 2 h)",
        "carbon intensity CA-ON: 2 of 2 h not measured (last-known:electricitymaps 2 h)")


def test_a_zone_without_live_sources_is_priced_on_the_bundled_replay_as_before(any_store):
    c = cache(any_store, SignalsSettings.model_validate({}), Clock(T1))
    env = LiveEnvironment(BrokerSettings().planner, signals=(c.settings, c))
    ledger.install(ledger.LedgerPrices.from_environment(env))
    try:
        e = _run_onprem(any_store)
        assert (e.price_source, e.estimated) == ("bundled-replay", False)
    finally:
        ledger.install(None)
        drop(c)


def test_an_api_process_meters_with_the_wirings_live_signals_and_cloud_prices(sqlite_store, monkeypatch):
    """``build_api`` (cloud reports and node heartbeats end attempts there) makes the ledger price through the
    wiring's planning environment: the live signal chain and the live cloud price cache, not the bundled replay."""
    from broker.service import wiring
    from broker.service.live import LiveSignals, ReplayedSignals
    from tests.conftest import REDIS_URL

    sg = SignalsSettings.model_validate({**_onprem_settings().model_dump(exclude_none=True),
                                         "cloud_prices": {"aws": ["us-east-1"]}})
    st = BrokerSettings(database_url=str(sqlite_store.engine.url), redis_url=REDIS_URL, signals=sg)
    c = cache(sqlite_store, sg, Clock(T1))
    svc = wiring.Services()
    svc.__dict__.update(settings=st, store=sqlite_store, signal_cache=c)
    monkeypatch.setattr(wiring, "services", svc)
    try:
        wiring.build_api(st)
        p = ledger.prices()
        assert p.cloud_cache is c
        assert isinstance(p.signals_for(T0.timestamp(), T1.timestamp()), LiveSignals)
        assert svc.__dict__["env"].signal_cache is c  # the one environment, built on first metering
        svc.reset()  # forgets the wiring's prices too: the next ones are the bundled cluster's replay
        assert isinstance(ledger.prices().signals_for(T0.timestamp(), T1.timestamp()), ReplayedSignals)
    finally:
        ledger.configure(None)
        drop(c)
