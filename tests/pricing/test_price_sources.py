"""Operator tariffs (fixed and time-of-use, DST days) and ENTSO-E day-ahead prices through entsoe-py (no network)."""

from __future__ import annotations

import numpy as np
import pytest
import responses
from entsoe import EntsoePandasClient
from entsoe.entsoe import URL as ENTSOE_URL

from pricing.fx import usd_per_unit
from pricing.price_sources import EntsoeDayAhead, Tariff, TariffError
from pricing.sources import RateLimited, SourceAuthError, SourceUnavailable, capabilities
from tests.pricing.recorded import ENTSOE_NO_DATA, entsoe_prices_xml, utc

H = 3600.0
EUR = usd_per_unit("EUR")
DE_LU = "10Y1001A1001A82H"

TOU = {"zone": "site", "timezone": "Europe/Berlin", "currency": "EUR", "per": "MWh", "default": 50,
       "periods": [{"name": "peak", "days": "all", "start": "07:00", "end": "19:00", "price": 100}]}


def _day(tariff: Tariff, start, end):
    return tariff.history("site", start.timestamp(), end.timestamp()).series.values / EUR


# ------------------------------------------------------------------------------------------------ tariff
def test_fixed_tariff_per_kwh_in_usd_per_mwh():
    t = Tariff({"zone": "site", "timezone": "America/Toronto", "currency": "CAD", "default": 0.1})
    got = t.history("site", utc(2024, 1, 1).timestamp(), utc(2024, 1, 1, 3).timestamp())
    assert got.series.unit == "USD/MWh" and not got.estimated.any() and not got.forecast
    assert got.series.values.tolist() == [pytest.approx(100.0 / 1.3495, rel=1e-12)] * 3
    assert capabilities(t) == ("latest", "history", "forecast")


def test_time_of_use_on_the_23_hour_spring_day_in_europe():
    # Berlin, Sun 2024-03-31: local midnight is 23:00Z the day before, the next is 22:00Z; 02:00 local does not exist
    v = _day(Tariff(TOU), utc(2024, 3, 30, 23), utc(2024, 3, 31, 22))
    assert v.size == 23
    assert v.tolist() == pytest.approx([50.0] * 6 + [100.0] * 12 + [50.0] * 5, rel=1e-12)  # 00,01,03..06 | 07..18 | 19..23


def test_time_of_use_on_the_25_hour_autumn_day_in_europe():
    # Berlin, Sun 2024-10-27: 22:00Z .. 23:00Z next day, 02:00 local happens twice
    v = _day(Tariff(TOU), utc(2024, 10, 26, 22), utc(2024, 10, 27, 23))
    assert v.size == 25
    assert v.tolist() == pytest.approx([50.0] * 8 + [100.0] * 12 + [50.0] * 5, rel=1e-12)  # 00..06 with 02 twice


def test_time_of_use_on_us_dst_days_weekday_periods_and_a_night_period_wrapping_midnight():
    cfg = {"zone": "site", "timezone": "America/New_York", "currency": "USD", "per": "kWh", "default": 0.10,
           "periods": [{"name": "night", "days": ["sat", "sun"], "start": "22:00", "end": "06:00", "price": 0.05},
                       {"name": "peak", "days": "weekdays", "start": "16:00", "end": "21:00", "price": 0.30}]}
    t = Tariff(cfg)
    # Sun 2024-03-10 (New York, 23 h): 05:00Z .. 04:00Z next day; the Sunday night period ran from Sat 22:00
    spring = t.history("site", utc(2024, 3, 10, 5).timestamp(), utc(2024, 3, 11, 4).timestamp()).series.values
    assert spring.size == 23
    # local 00,01,03,04,05 -> night (5 h: wraps from Saturday), 06..21 -> default (16 h), 22,23 -> night (Sunday)
    assert spring.tolist() == pytest.approx([50.0] * 5 + [100.0] * 16 + [50.0] * 2, rel=1e-12)
    # Mon 2024-03-11 00:00..05:59 local: Sunday's night period wraps into Monday; 16..20 weekday peak
    mon = t.history("site", utc(2024, 3, 11, 4).timestamp(), utc(2024, 3, 12, 4).timestamp()).series.values
    assert mon.tolist() == pytest.approx([50.0] * 6 + [100.0] * 10 + [300.0] * 5 + [100.0] * 3, rel=1e-12)
    # Sun 2024-11-03 (25 h): 04:00Z .. 05:00Z next day; 01:00 local twice
    autumn = t.history("site", utc(2024, 11, 3, 4).timestamp(), utc(2024, 11, 4, 5).timestamp()).series.values
    assert autumn.size == 25
    assert autumn.tolist() == pytest.approx([50.0] * 7 + [100.0] * 16 + [50.0] * 2, rel=1e-12)


def test_tariff_latest_and_forecast():
    t = Tariff(TOU)
    now = utc(2024, 6, 3, 10, 30).timestamp()  # 12:30 CEST
    lat = t.latest("site", now)
    assert lat.series.start_s == utc(2024, 6, 3, 10).timestamp() and lat.series.values[0] / EUR == pytest.approx(100)
    f = t.forecast("site", now, now + 2 * H)
    assert f.forecast and f.series.values.size == 3
    with pytest.raises(ValueError, match="zone='other'"):
        t.history("other", now, now + H)


@pytest.mark.parametrize("patch, needle", [
    ({"timezone": "Mars/Olympus"}, "tariff.timezone='Mars/Olympus'"),
    ({"currency": "XYZ"}, "tariff.currency: currency='XYZ'"),
    ({"per": "GJ"}, "tariff.per='GJ'"),
    ({"default": "cheap"}, "tariff.default='cheap'"),
    ({"colour": "red"}, "unknown field(s) colour"),
    ({"periods": [{"days": "sometimes", "start": "07:00", "end": "19:00", "price": 1}]}, "tariff.periods[0].days"),
    ({"periods": [{"days": "all", "start": "7am", "end": "19:00", "price": 1}]}, "tariff.periods[0].start='7am'"),
    ({"periods": [{"days": "all", "start": "07:00", "end": "25:00", "price": 1}]}, "tariff.periods[0].end='25:00'"),
    ({"periods": [{"days": "all", "start": "07:00", "end": "07:00", "price": 1}]}, "equals start"),
    ({"periods": [{"days": "all", "start": "07:00", "end": "19:00"}]}, "tariff.periods[0].price: missing"),
])
def test_bad_tariff_config_names_the_field(patch, needle):
    with pytest.raises(TariffError) as e:
        Tariff({**TOU, **patch})
    assert needle in str(e.value)
    with pytest.raises(TariffError, match="tariff.zone: missing"):
        Tariff({k: v for k, v in TOU.items() if k != "zone"})


# ------------------------------------------------------------------------------------------------ ENTSO-E
@pytest.fixture
def entsoe_server():
    """Serve A44 documents: offset 0 gets ``doc['xml']``, further offsets the 'No matching data' acknowledgement."""
    doc = {"xml": None, "status": 200, "headers": {}}

    def answer(request):
        from urllib.parse import parse_qs, urlparse

        q = parse_qs(urlparse(request.url).query)
        assert q["documentType"] == ["A44"] and q["in_Domain"] == [DE_LU]
        if doc["status"] != 200:
            return doc["status"], doc["headers"], "<html>error</html>"
        if q.get("offset", ["0"]) != ["0"] or doc["xml"] is None:
            return 200, {"Content-Type": "application/xml"}, ENTSOE_NO_DATA
        return 200, {"Content-Type": "application/xml"}, doc["xml"]

    with responses.RequestsMock(assert_all_requests_are_fired=False) as r:
        r.add_callback(responses.GET, ENTSOE_URL, callback=answer)
        yield doc


def _src() -> EntsoeDayAhead:
    return EntsoeDayAhead(client=EntsoePandasClient(api_key="tok", retry_count=1, retry_delay=0))


def test_entsoe_25_hour_day_with_negative_prices(entsoe_server):
    prices = [float(p) for p in range(-12, 13)]  # 25 hourly prices, -12 .. 12 EUR/MWh
    entsoe_server["xml"] = entsoe_prices_xml(DE_LU, utc(2024, 10, 26, 22), 60, prices)
    got = _src().history("DE-LU", utc(2024, 10, 26, 22).timestamp(), utc(2024, 10, 27, 23).timestamp())
    assert got.series.values.size == 25 and got.series.unit == "USD/MWh" and got.missing == 0
    assert (got.series.values / EUR).tolist() == pytest.approx(prices, rel=1e-12)  # negative prices kept, no hour lost
    assert not got.forecast


def test_entsoe_23_hour_day(entsoe_server):
    prices = [100.0 + k for k in range(23)]
    entsoe_server["xml"] = entsoe_prices_xml(DE_LU, utc(2024, 3, 30, 23), 60, prices)
    got = _src().forecast("DE-LU", utc(2024, 3, 30, 23).timestamp(), utc(2024, 3, 31, 22).timestamp())
    assert got.forecast and (got.series.values / EUR).tolist() == pytest.approx(prices, rel=1e-12)


def test_entsoe_15_minute_prices_averaged_to_hours_after_sign_handling_on_the_2025_autumn_dst_day(entsoe_server):
    # Berlin, Sun 2025-10-26 (25 h) after the 15-minute SDAC go-live: 100 quarter-hours
    q = [-40.0, -20.0, 0.0, 20.0] * 25  # each hour: mean -10 (clamping negatives to 0 first would give +5)
    q[4 * 24:] = [80.0, 60.0, -30.0, 10.0]  # the last hour: mean 30
    entsoe_server["xml"] = entsoe_prices_xml(DE_LU, utc(2025, 10, 25, 22), 15, q)
    got = _src().history("DE-LU", utc(2025, 10, 25, 22).timestamp(), utc(2025, 10, 26, 23).timestamp())
    v = got.series.values / EUR
    assert v.size == 25 and got.missing == 0
    assert v.tolist() == pytest.approx([-10.0] * 24 + [30.0], rel=1e-12)


def test_entsoe_no_matching_data_is_missing_hours(entsoe_server):
    got = _src().forecast("DE-LU", utc(2030, 1, 1).timestamp(), utc(2030, 1, 2).timestamp())
    assert got.missing == 24 and np.isnan(got.series.values).all()


def test_entsoe_an_hour_short_of_quarters_is_missing(entsoe_server):
    q = [10.0] * 8
    entsoe_server["xml"] = entsoe_prices_xml(DE_LU, utc(2025, 11, 3, 0), 15, q[:7])  # hour 1 lacks its last quarter
    got = _src().history("DE-LU", utc(2025, 11, 3, 0).timestamp(), utc(2025, 11, 3, 2).timestamp())
    assert got.series.values[0] / EUR == pytest.approx(10.0) and np.isnan(got.series.values[1])


@pytest.mark.parametrize("status, headers, exc, attr", [(429, {"Retry-After": "60"}, RateLimited, 60.0),
                                                        (401, {}, SourceAuthError, None),
                                                        (503, {}, SourceUnavailable, None)])
def test_entsoe_http_errors(entsoe_server, status, headers, exc, attr):
    entsoe_server.update(status=status, headers=headers)
    with pytest.raises(exc) as e:
        _src().history("DE-LU", utc(2024, 1, 1).timestamp(), utc(2024, 1, 2).timestamp())
    assert e.value.status == status and "tok" not in str(e.value)
    if exc is RateLimited:
        assert e.value.retry_after_s == attr


def test_entsoe_without_key_and_unknown_area(monkeypatch):
    monkeypatch.delenv("ENTSOE_API_KEY", raising=False)
    with pytest.raises(SourceAuthError, match="ENTSOE_API_KEY"):
        EntsoeDayAhead().history("DE-LU", 0, H)
    assert capabilities(EntsoeDayAhead(api_key="x")) == ("history", "forecast")
    with pytest.raises(ValueError, match="zone='XX-YY'"):
        _src().history("XX-YY", utc(2024, 1, 1).timestamp(), utc(2024, 1, 1, 1).timestamp())


def test_entsoe_start_need_not_be_on_the_hour(entsoe_server):
    entsoe_server["xml"] = entsoe_prices_xml(DE_LU, utc(2024, 5, 1), 60, [1.0, 2.0, 3.0])
    a = utc(2024, 5, 1).timestamp() + 1800
    got = _src().history("DE-LU", a, a + 2 * H)  # hours 00, 01, 02 (the window touches three hours)
    assert (got.series.values / EUR).tolist() == pytest.approx([1.0, 2.0, 3.0])
    assert got.series.start_s == utc(2024, 5, 1).timestamp()
    assert got.origin.tolist() == ["entsoe-day-ahead"] * 3


def test_entsoe_token_never_reaches_the_logs(entsoe_server, caplog):
    import logging

    entsoe_server["xml"] = entsoe_prices_xml(DE_LU, utc(2024, 5, 1), 60, [1.0])
    with caplog.at_level(logging.DEBUG):
        _src().history("DE-LU", utc(2024, 5, 1).timestamp(), utc(2024, 5, 1, 1).timestamp())
    assert "tok" not in caplog.text and "securityToken" not in caplog.text
