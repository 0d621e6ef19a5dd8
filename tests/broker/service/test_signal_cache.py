"""The live signal cache: refresh under the single-leader rule, Redis + database copies, rate limits and
back-off, the planner's view with its fallbacks and explanations, and the metrics. No test reaches the network
(``responses`` answers every request; an unregistered URL is a ConnectionError)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import responses

from broker.service.live import LiveSignals, REPLAY, WEEK_S
from broker.service.signal_cache import SignalCache
from broker.service.store import signals as rows
from pricing.carbon import load_carbon_intensity
from pricing.signals import load_grid_signals
from tests.broker.service.signals_setup import EM, T0, Clock, Sleeps, cache, drop, em_fc, em_history, settings
from tests.pricing.recorded import utc

H = 3600.0


@pytest.fixture
def rsps():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as r:
        yield r


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv("ELECTRICITYMAPS_API_KEY", "test-key-not-logged")


@pytest.fixture
def sc(any_store):
    clock = Clock(T0)
    c = cache(any_store, settings(), clock)
    yield c
    drop(c)


def test_refresh_writes_measured_over_forecast_to_the_database_and_redis(sc, rsps):
    em_history(rsps)
    em_fc(rsps)
    r = sc.refresh("DE-LU", "carbon")
    assert r.claimed and r.fetched == {"electricitymaps": 5} and r.errors == {}
    assert [c.request.headers["auth-token"] for c in rsps.calls] == ["test-key-not-logged"] * 2
    assert rsps.calls[0].request.params == {"zone": "DE", "start": "2024-03-31T09:00Z", "end": "2024-03-31T13:00Z"}
    with sc.store.session() as s:
        got = rows.value_rows(s, [("electricitymaps", "DE-LU")], utc(2024, 3, 31), utc(2024, 4, 1))
    assert [(h.hour_at.hour, h.value, h.forecast) for h in got] == [
        (9, 300.0, False), (10, 310.0, False), (12, 330.0, False), (13, 340.0, True), (14, 350.0, True)]
    h = sc.hours("electricitymaps", "DE-LU", utc(2024, 3, 31, 9).timestamp(), 7)
    np.testing.assert_array_equal(h.values, [300, 310, np.nan, 330, 340, 350, np.nan])
    np.testing.assert_array_equal(h.forecast, [False, False, False, False, True, True, False])
    # a later forecast for 12:00 never overwrites its measurement
    with sc.store.session() as s:
        rows.put_values(s, "carbon", "gCO2e/kWh", [got[2]._replace(value=999.0, forecast=True)])
        again = rows.value_rows(s, [("electricitymaps", "DE-LU")], utc(2024, 3, 31, 12), utc(2024, 3, 31, 13))
    assert [(x.value, x.forecast) for x in again] == [(330.0, False)]


def test_one_fetch_per_zone_per_period_across_processes(pg_store, rsps):
    em_history(rsps)
    em_fc(rsps)
    clock = Clock(T0)
    a = cache(pg_store, settings(), clock)
    b = SignalCache(pg_store, a.redis, a.settings, prefix=a.prefix, clock=clock, sleep=Sleeps())  # "another process"
    go = threading.Barrier(2)
    out = {}

    def run(name, c):
        go.wait()
        out[name] = c.refresh("DE-LU", "carbon")

    ts = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", a), ("b", b))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(r.claimed for r in out.values()) == [False, True]
    assert len(rsps.calls) == 2  # one history + one forecast request, not two of each
    ttl = a.redis.pttl(f"{a.prefix}refresh:carbon:DE-LU")
    assert 890_000 < ttl <= 900_000  # the claim is the 900-s period
    assert not b.refresh("DE-LU", "carbon").claimed and len(rsps.calls) == 2
    # the other process reads the values from the shared Redis copy: a cache hit, no request
    h = b.hours("electricitymaps", "DE-LU", utc(2024, 3, 31, 12).timestamp(), 3)
    np.testing.assert_array_equal(h.values, [330, 340, 350])
    assert len(rsps.calls) == 2
    drop(a)


def test_redis_lost_the_cache_the_database_copy_is_loaded_back(sc, rsps):
    em_history(rsps)
    em_fc(rsps)
    sc.refresh("DE-LU", "carbon")
    drop(sc)  # Redis restarted empty
    h = sc.hours("electricitymaps", "DE-LU", utc(2024, 3, 31, 9).timestamp(), 6)
    np.testing.assert_array_equal(h.values, [300, 310, np.nan, 330, 340, 350])
    assert sc.version() == 1 and 3590 <= sc.redis.ttl(f"{sc.prefix}warm") <= 3600  # reloaded again within the hour


def test_429_retry_after_then_success_sleeps_what_the_server_asked(sc, rsps):
    em_history(rsps, status=429, headers={"Retry-After": "3"})
    em_history(rsps, status=429, headers={"Retry-After": "5"})
    em_history(rsps)
    em_fc(rsps)
    r = sc.refresh("DE-LU", "carbon")
    assert r.fetched == {"electricitymaps": 5}
    assert sc.sleep == [3.0, 5.0] and len(rsps.calls) == 4


def test_5xx_retried_with_doubling_back_off_then_recorded(sc, rsps):
    for _ in range(3):
        em_history(rsps, status=503)
    r = sc.refresh("DE-LU", "carbon")
    assert r.errors == {"electricitymaps": "unavailable: GET /carbon-intensity/past-range: HTTP 503"}
    assert sc.sleep == [2.0, 4.0] and len(rsps.calls) == 3
    with sc.store.session() as s:
        (f,) = rows.fetch_rows(s)
    assert (f.last_success_at, f.error_counts, f.last_error) == (
        None, {"unavailable": 1}, "unavailable: GET /carbon-intensity/past-range: HTTP 503")


def test_long_retry_after_and_401_after_success_put_the_source_in_back_off(sc, rsps):
    em_history(rsps)
    em_fc(rsps)
    sc.refresh("DE-LU", "carbon")
    sc.clock.t += 600
    # Electricity Maps answers a rate limit with 401 (electricitymaps-contrib#8047): read as a rate limit
    em_history(rsps, status=401)
    em_history(rsps, status=429, headers={"Retry-After": "120"})
    r = sc.refresh("DE-LU", "carbon", force=True)
    assert sc.sleep == [2.0]  # the 401 after a success: backoff_s; then Retry-After 120 > max_backoff_s 30: give up
    assert r.errors == {"electricitymaps": "rate_limited: GET /carbon-intensity/past-range: HTTP 429"}
    assert sc.backoff_until("electricitymaps") == pytest.approx(T0.timestamp() + 600 + 120)
    n = len(rsps.calls)
    r = sc.refresh("DE-LU", "carbon", force=True)
    assert len(rsps.calls) == n  # backing off: nothing sent
    assert r.skipped == {"electricitymaps": "backing off until 2024-03-31T12:32:00+00:00 (rate limited)"}


def test_token_bucket_spaces_requests(sqlite_store, rsps):
    em_history(rsps)
    em_fc(rsps)
    sg = settings(sources={"electricitymaps": {"requests_per_s": 0.5, "burst": 1, "max_backoff_s": 30.0}})
    slept = []

    def sleep(s):  # really waits: the bucket refills on Redis's clock
        slept.append(s)
        time.sleep(s)

    c = cache(sqlite_store, sg, Clock(T0), sleep=sleep)
    c.refresh("DE-LU", "carbon")
    # the second request found the 1-token bucket empty: waited 2 s (1 token at 0.5/s), less the first call's time
    assert len(slept) == 1 and 1.5 < slept[0] <= 2.0
    drop(c)


def test_an_empty_answer_is_a_failed_fetch(sc, rsps):
    rsps.add(responses.GET, f"{EM}/carbon-intensity/past-range", json={"zone": "DE", "data": []})
    rsps.add(responses.GET, f"{EM}/carbon-intensity/forecast", json={"zone": "DE", "forecast": []})
    r = sc.refresh("DE-LU", "carbon")
    assert r.errors == {"electricitymaps": "empty: no value for DE-LU in the window (an empty answer)"}


def _live(sc, now_s, ahead_h=4):
    base = load_grid_signals(["DE-LU"])
    return LiveSignals(base, 52 * WEEK_S, sc, sc.settings, now_s, ahead_h * H)


def test_fresh_values_interpolated_gap_then_the_bundled_replay(sc, rsps):
    em_history(rsps)
    em_fc(rsps)
    sc.refresh("DE-LU", "carbon")
    sc.clock.t += 600
    live = _live(sc, sc.clock.t)
    checked, fc, fetched = live.checked("DE-LU", "carbon")
    t15 = utc(2024, 3, 31, 15).timestamp()
    bundled15 = load_carbon_intensity("DE-LU").value_at(t15 - 52 * WEEK_S)
    np.testing.assert_allclose(checked.series.values, [300, 310, 320, 330, 340, 350, bundled15])
    assert list(checked.origin) == ["electricitymaps"] * 2 + ["interpolated"] + ["electricitymaps"] * 3 + [REPLAY]
    assert list(fc) == [False, False, False, False, True, True, False]
    # the planner's series: the replay with the window replaced
    s = live.carbon("DE-LU")
    assert s.value_at(utc(2024, 3, 31, 13, 30)) == 340.0
    assert s.value_at(utc(2024, 3, 31, 20)) == load_carbon_intensity("DE-LU").value_at(
        utc(2024, 3, 31, 20).timestamp() - 52 * WEEK_S)
    (e,) = live.explain([("DE-LU", "carbon")], sc.clock.t)
    assert e == {"zone": "DE-LU", "kind": "carbon", "source": "electricitymaps", "age_s": 600.0, "forecast": False,
                 "estimated": False, "fallback": False, "replay_offset_s": 52 * WEEK_S,
                 "hours": {"electricitymaps": 3, REPLAY: 1}, "note": "carbon DE-LU: electricitymaps (measured, 0.2 h old)"}


def test_sources_down_last_known_then_replay_says_so_and_recovers(sc, rsps):
    from broker.service.metrics import signal_families

    em_history(rsps)
    em_fc(rsps)
    sc.refresh("DE-LU", "carbon")
    sc.clock.t += 2 * H  # 14:20: the 12:20 fetch is past stale_after_s (1 h); the feed is down
    rsps.replace(responses.GET, f"{EM}/carbon-intensity/past-range", status=503)
    sc.refresh("DE-LU", "carbon", force=True)
    live = _live(sc, sc.clock.t)
    checked, fc, _ = live.checked("DE-LU", "carbon")  # 11:00 .. 17:00
    rep = [load_carbon_intensity("DE-LU").value_at(utc(2024, 3, 31, h).timestamp() - 52 * WEEK_S) for h in (11, 15, 16, 17)]
    np.testing.assert_allclose(checked.series.values, [rep[0], 330, 340, 350, *rep[1:]])
    assert list(checked.origin) == [REPLAY] + ["last-known:electricitymaps"] * 3 + [REPLAY] * 3
    assert checked.estimated.all()
    (e,) = live.explain([("DE-LU", "carbon")], sc.clock.t)
    assert e["source"] == "last-known:electricitymaps" and e["age_s"] == 7200.0 and e["forecast"] and e["fallback"]
    assert e["note"] == ("carbon DE-LU: no fresh value from electricitymaps; deciding on electricitymaps's last known "
                         "value (forecast, 2.0 h old) (next 48 h: bundled-replay 3 h, last-known:electricitymaps 1 h)")
    fams = {f.name: f for f in signal_families(sc.store, sc.clock.t)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("fedbroker_signal_age_seconds", (("kind", "carbon"), ("source", "electricitymaps"),
                                                     ("zone", "DE-LU")))] == 7200.0
    assert samples[("fedbroker_signal_fallback", (("kind", "carbon"), ("zone", "DE-LU")))] == 1.0
    assert samples[("fedbroker_signal_fetch_errors_total", (("error", "unavailable"),
                                                            ("source", "electricitymaps")))] == 1.0
    # every source down for longer than the cache keeps anything: the replay alone, still never 0
    sc.clock.t += 30 * H
    live = _live(sc, sc.clock.t)
    (e,) = live.explain([("DE-LU", "carbon")], sc.clock.t)
    assert e["source"] == REPLAY and e["fallback"] and e["note"].startswith(
        "carbon DE-LU: no fresh value from electricitymaps; deciding on the bundled 2023-24 history replayed +52 weeks")
    # the feed is back: the next refresh makes the zone fresh again
    sc.clock.t = T0.timestamp() + 2 * H
    rsps.replace(responses.GET, f"{EM}/carbon-intensity/past-range", json={"zone": "DE", "data": [
        {"zone": "DE", "carbonIntensity": 345, "datetime": "2024-03-31T14:00:00.000Z", "isEstimated": False}]})
    r = sc.refresh("DE-LU", "carbon", force=True)
    assert r.fetched == {"electricitymaps": 1} and r.errors == {}  # 14:00 (measured; the forecast has only 14:00 ahead)
    live = _live(sc, sc.clock.t)
    (e,) = live.explain([("DE-LU", "carbon")], sc.clock.t)
    assert (e["source"], e["age_s"], e["forecast"], e["fallback"]) == ("electricitymaps", 0.0, False, False)
    assert live.carbon("DE-LU").value_at(utc(2024, 3, 31, 14, 30)) == 345.0
    fams = {f.name: f for f in signal_families(sc.store, sc.clock.t)}
    assert [s.value for s in fams["fedbroker_signal_fallback"].samples] == [0.0]


def test_hours_no_source_has_come_from_the_forecast_model_before_the_replay(sqlite_store, rsps):
    # a day of measured hours (prev. day 12:00 .. 11:00 = 100 .. 123) and the feed's forecast for 12:00 only:
    # 13:00-15:00 are the blend model's (no week-old hour and no departure with one day: the same hour
    # yesterday, 101-103), not the bundled 2023-24 replay
    from broker.service.live import FORECAST_MODEL
    from tests.pricing.recorded import em_forecast, em_point

    sc = cache(sqlite_store, settings(history_h=24), Clock(T0))
    try:
        day0 = utc(2024, 3, 30, 12)
        rsps.add(responses.GET, f"{EM}/carbon-intensity/past-range", json={"zone": "DE", "data": [
            em_point("DE", day0 + timedelta(hours=k), 100 + k) for k in range(24)]})
        rsps.add(responses.GET, f"{EM}/carbon-intensity/forecast",
                 json=em_forecast("DE", [(utc(2024, 3, 31, 12), 335)]))
        sc.refresh("DE-LU", "carbon")
        live = _live(sc, sc.clock.t)
        checked, fc, _ = live.checked("DE-LU", "carbon")  # prev. day 12:00 .. 15:00
        assert checked.series.values.size == 28
        np.testing.assert_allclose(checked.series.values, [100 + k for k in range(24)] + [335, 101, 102, 103])
        assert list(checked.origin[-4:]) == ["electricitymaps", FORECAST_MODEL, FORECAST_MODEL, FORECAST_MODEL]
        assert fc[-4:].all() and checked.estimated[-3:].all() and not checked.estimated[:24].any()
    finally:
        drop(sc)


def test_seeded_user_files_are_last_known_values(sc, tmp_path):
    from pricing.user_signals import load_user_signals

    (tmp_path / "de.csv").write_text("zone,hour_utc,value,unit,quality\n"
                                     "DE-LU,2024-03-31T12:00Z,401,gCO2e/kWh,measured\n"
                                     "DE-LU,2024-03-31T13:00Z,402,gCO2e/kWh,estimated\n")
    assert sc.seed(load_user_signals(tmp_path)) == {"carbon DE-LU": 2}
    live = _live(sc, sc.clock.t)
    checked, _, _ = live.checked("DE-LU", "carbon")
    assert list(checked.series.values[3:5]) == [401.0, 402.0]
    assert list(checked.origin[3:5]) == ["last-known:user"] * 2


def test_a_planning_cycle_explains_its_signals_fallback_then_fresh(pg_store):
    """End to end through the live cycle: the decision's explain record says where each signal came from."""
    from datetime import datetime, timezone

    from broker.model import JobSpec
    from broker.service.cycle import PlanningCycle
    from broker.service.live import LiveEnvironment
    from broker.service.settings import BrokerSettings
    from broker.service.store.signals import CachedHour

    sg = settings(zones={"CA-ON": {"carbon": ["electricitymaps", "bundled"]}})
    c = cache(pg_store, sg, time.time)
    try:
        st = BrokerSettings()
        env = LiveEnvironment(st.planner, signals=(sg, c))
        pg_store.heartbeat("n1", "local", "V100", 2, 16.0, [0, 1], "agent-1")
        cyc = PlanningCycle(pg_store, env, st, dispatch=lambda j, a: None)
        spec = JobSpec(command=["true"], estimated_duration_s=600.0)
        a = pg_store.submit("ml", spec)[0].id
        cyc.run()
        carbon, price = pg_store.decision(a)["signals"]
        offset = env.offset_for(time.time())
        assert (carbon["zone"], carbon["kind"], carbon["source"], carbon["age_s"], carbon["fallback"]) == (
            "CA-ON", "carbon", REPLAY, None, True)
        assert carbon["note"].startswith("carbon CA-ON: no fresh value from electricitymaps; deciding on the bundled "
                                         f"2023-24 history replayed +{offset / WEEK_S:.0f} weeks")
        assert price == {"zone": "CA-ON", "kind": "price", "source": REPLAY, "age_s": None, "forecast": False,
                         "estimated": True, "fallback": False, "replay_offset_s": offset, "hours": {},
                         "note": f"price CA-ON: bundled 2023-24 history replayed +{offset / WEEK_S:.0f} weeks "
                                 "(no live source configured for the zone)"}
        # the feed delivers (as the refresh task would): the next decision is on it, fresh
        now = time.time()
        h = datetime.fromtimestamp(now // 3600 * 3600, tz=timezone.utc)
        with pg_store.session() as s:
            rows.put_values(s, "carbon", "gCO2e/kWh", [CachedHour("electricitymaps", "CA-ON", h + timedelta(hours=k),
                                                                  40.0 + k, False, k > 0,
                                                                  datetime.fromtimestamp(now - 60, tz=timezone.utc))
                                                       for k in range(3)])
        c._mirror("electricitymaps", "CA-ON", h.timestamp() - H, h.timestamp() + 4 * H)
        b = pg_store.submit("ml", spec)[0].id
        cyc.run()
        carbon, _ = pg_store.decision(b)["signals"]
        assert (carbon["source"], carbon["forecast"], carbon["fallback"]) == ("electricitymaps", False, False)
        assert carbon["age_s"] == pytest.approx(60.0, abs=10.0)
        assert carbon["hours"]["electricitymaps"] == 3
        assert env.context([], time.time()).signals.carbon("CA-ON").value_at(now) == 40.0
    finally:
        drop(c)


def test_a_tariff_zone_is_priced_by_its_contract(sqlite_store):
    from pricing.fx import usd_per_unit

    sg = settings(zones={"CA-ON": {"price": ["tariff"]}},
                  tariffs={"CA-ON": {"timezone": "America/Toronto", "currency": "CAD", "per": "kWh", "default": 0.1}})
    c = cache(sqlite_store, sg, Clock(T0))
    try:
        r = c.refresh("CA-ON", "price")
        assert r.fetched == {"tariff": 6}  # 09:00..14:00: 3 h back + the current hour, 3 h ahead
        base = load_grid_signals(["CA-ON"])
        live = LiveSignals(base, 52 * WEEK_S, c, sg, c.clock.t, 2 * H)
        usd = 0.1 * 1000 * usd_per_unit("CAD")
        assert live.price("CA-ON").value_at(utc(2024, 3, 31, 13, 30)) == pytest.approx(usd)
        (e,) = live.explain([("CA-ON", "price")], c.clock.t)
        assert (e["source"], e["forecast"], e["fallback"], e["age_s"]) == ("tariff", False, False, 0.0)
        (e,) = live.explain([("CA-ON", "carbon")], c.clock.t)  # no carbon chain: the replay
        assert (e["source"], e["fallback"]) == (REPLAY, False)
    finally:
        drop(c)


def test_the_beat_task_refreshes_each_zone_once_per_period_and_wakes_the_planner(sqlite_store, monkeypatch):
    from broker.service import tasks, wiring

    sg = settings(zones={"CA-ON": {"price": ["tariff"]}},
                  tariffs={"CA-ON": {"timezone": "America/Toronto", "currency": "CAD", "default": 0.1}})
    c = cache(sqlite_store, sg, time.time)
    kicks = []
    monkeypatch.setitem(wiring.services.__dict__, "signal_cache", c)
    monkeypatch.setattr(tasks, "kick_planner", lambda: kicks.append(1))
    try:
        out = tasks.signals_refresh()
        assert out == {"CA-ON price": {"fetched": {"tariff": 6}, "errors": {}, "skipped": {}}}  # 3 h back + now, 2 more ahead
        assert kicks == [1]
        assert tasks.signals_refresh() == {} and kicks == [1]  # the period is claimed: nothing fetched again
    finally:
        drop(c)


def test_refresh_all_stops_starting_zones_after_its_time_budget(sqlite_store):
    tariff = {"timezone": "UTC", "currency": "USD", "default": 0.1}
    sg = settings(zones={"CA-ON": {"price": ["tariff"]}, "DE-LU": {"price": ["tariff"]}},
                  tariffs={"CA-ON": tariff, "DE-LU": tariff})
    c = cache(sqlite_store, sg, Clock(T0))
    try:
        first = c.refresh_all(budget_s=0.0)  # the budget is spent after the first zone: the second waits
        assert [(r.zone, r.claimed) for r in first] == [("CA-ON", True)]
        assert not c.redis.exists(f"{c.prefix}refresh:price:DE-LU")
        assert [(r.zone, r.claimed) for r in c.refresh_all()] == [("CA-ON", False), ("DE-LU", True)]
    finally:
        drop(c)


def test_entsoe_day_ahead_through_the_cache_on_the_23_hour_day(sqlite_store, monkeypatch):
    """ENTSO-E (entsoe-py, key from ENTSOE_API_KEY) through the cache on 2024-03-31, Europe's 23-hour spring day:
    the day-ahead prices of 09:00-12:00 UTC are history, 13:00-14:00 the forecast, negative prices kept."""
    from entsoe.entsoe import URL as ENTSOE_URL

    from pricing.fx import usd_per_unit
    from tests.pricing.recorded import ENTSOE_NO_DATA, entsoe_prices_xml

    monkeypatch.setenv("ENTSOE_API_KEY", "tok-never-logged")
    day = [float(k) - 15.0 for k in range(23)]  # 23 hourly prices from 2024-03-30 23:00 UTC (00:00 CET): -15 .. 7
    xml = entsoe_prices_xml("10Y1001A1001A82H", utc(2024, 3, 30, 23), 60, day)
    sg = settings(zones={"DE-LU": {"price": ["entsoe-day-ahead", "bundled"]}})
    c = cache(sqlite_store, sg, Clock(T0))
    try:
        with responses.RequestsMock(assert_all_requests_are_fired=False) as r:
            def answer(request):  # the document at offset 0; later pages: "no matching data" (ENTSO-E paging)
                from urllib.parse import parse_qs, urlparse

                q = parse_qs(urlparse(request.url).query)
                assert q["securityToken"] == ["tok-never-logged"] and q["in_Domain"] == ["10Y1001A1001A82H"]
                return 200, {"Content-Type": "application/xml"}, xml if q.get("offset", ["0"]) == ["0"] else ENTSOE_NO_DATA

            r.add_callback(responses.GET, ENTSOE_URL, callback=answer)
            res = c.refresh("DE-LU", "price")
            assert len([c for c in r.calls if "offset=0" in c.request.url or "offset" not in c.request.url]) == 2
        assert res.fetched == {"entsoe-day-ahead": 6} and res.errors == {}
        h = c.hours("entsoe-day-ahead", "DE-LU", utc(2024, 3, 31, 9).timestamp(), 6)
        eur = usd_per_unit("EUR")
        # 09:00 UTC is hour 10 of the CET/CEST day (23:00 UTC + 10 h): -5 EUR/MWh
        np.testing.assert_allclose(h.values / eur, [-5, -4, -3, -2, -1, 0])
        assert list(h.forecast) == [False] * 4 + [True] * 2
    finally:
        drop(c)


def test_a_source_without_its_key_is_an_auth_error_and_says_where_the_key_goes(sqlite_store, monkeypatch):
    monkeypatch.delenv("ENTSOE_API_KEY", raising=False)
    sg = settings(zones={"DE-LU": {"price": ["entsoe-day-ahead", "bundled"]}})
    c = cache(sqlite_store, sg, Clock(T0))
    try:
        r = c.refresh("DE-LU", "price")  # nothing is sent: responses is not even active, and no error escapes
        assert r.errors == {"entsoe-day-ahead": "auth: no API key: set ENTSOE_API_KEY"}
        health = {(e["kind"], e["source"]): e["health"] for e in c.health()}
        assert health[("price", "entsoe-day-ahead")] == "no API key ($ENTSOE_API_KEY)"
    finally:
        drop(c)
